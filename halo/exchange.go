package halo

import (
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

func (p *Plan) dir(d Direction) (*dirCall, error) {
	switch d {
	case DirForward:
		return &p.fwd, nil
	case DirBackward:
		return &p.bwd, nil
	}
	return nil, fmt.Errorf("%w: rank %d: direction %d of plan %d is neither forward (0) nor backward (1)", ErrInvalid, p.g.Rank(), d, p.id)
}

// Call names one of a plan's exchanges, for callers that dispatch on it.
type Call int

// Each call's tensors, in the order Do takes them:
const (
	// x, out: fills out = [left halo | x | right halo] along dim. x may be
	// the interior of out (same strides, at slice Left): then it is not
	// copied.
	CallForward Call = iota
	// grad_out, grad_x: grad_x = the interior of grad_out + the gradients
	// of x's slices that other ranks used as halo. grad_x may be the
	// interior of grad_out.
	CallBackward
	// x, left, right: fills a halos-only plan's left and right tensors with
	// the slices before and after x in the global sequence.
	CallHalosForward
	// grad_left, grad_right, grad_x: sends the halo gradients and adds the
	// neighbours' gradients of x's slices into grad_x, which holds the rest
	// of x's gradient already.
	CallHalosBackward
)

// Do runs call c with its tensors in that order (t2 unused by the padded
// calls). Without wait it only begins the exchange: it returns once the
// messages are posted and the local work that needs nothing from the wire
// is done, and Test or Wait finishes it. One exchange per direction may be
// in flight; the caller's tensors belong to it until it completes.
func (p *Plan) Do(c Call, wait bool, t0, t1, t2 unsafe.Pointer) error {
	if len(p.specs) != 1 {
		return fmt.Errorf("%w: rank %d: plan %d has %d layouts: pass one tensor per layout (the multi calls)", ErrInvalid, p.g.Rank(), p.id, len(p.specs))
	}
	a, b, d := [1]unsafe.Pointer{t0}, [1]unsafe.Pointer{t1}, [1]unsafe.Pointer{t2}
	return p.DoMulti(c, wait, a[:], b[:], d[:])
}

// DoMulti is Do for a plan of several layouts: each argument holds one
// tensor per layout, in the order the layouts were given to NewMultiPlan.
func (p *Plan) DoMulti(c Call, wait bool, a, b, d []unsafe.Pointer) error {
	dc, halos, err := p.call(c)
	if err != nil {
		return err
	}
	if err := p.startable(dc, halos); err != nil {
		return err
	}
	if c == CallHalosBackward {
		b, d = d, b // grad_x is base 1
	}
	K, per := len(p.specs), 2
	if halos {
		per = 3
	}
	for _, arg := range [][]unsafe.Pointer{a, b, d}[:per] {
		if len(arg) != K {
			return fmt.Errorf("%w: rank %d: %s of plan %d: %d tensors for %d layouts", ErrInvalid, p.g.Rank(), dc.what, p.id, len(arg), K)
		}
	}
	for k := 0; k < K; k++ {
		dc.ptrs[per*k], dc.ptrs[per*k+1] = a[k], b[k]
		if per == 3 {
			dc.ptrs[per*k+2] = d[k]
		}
	}
	// The tensors are checked against the instance this call tries before
	// it takes a number, so that a bad pointer fails here alone.
	if p.cur != nil {
		if err := p.cur.check(p.cur.sched(dc.d), dc.ptrs); err != nil {
			return err
		}
	}
	dc.halos, dc.seq, dc.agreed = halos, p.g.nextSeq(), false
	if err := p.attempt(dc, p.cur); err != nil {
		return err
	}
	dc.inFlight = true // (arrived, ready, ag and err were cleared when the last call ended)
	if wait {
		// Nothing else runs on the group until it returns (and its own
		// waits progress the others): it need not be listed.
		return p.settle(dc)
	}
	p.g.inflight = append(p.g.inflight, dc)
	return nil
}

func (p *Plan) call(c Call) (*dirCall, bool, error) {
	switch c {
	case CallForward:
		return &p.fwd, false, nil
	case CallBackward:
		return &p.bwd, false, nil
	case CallHalosForward:
		return &p.fwd, true, nil
	case CallHalosBackward:
		return &p.bwd, true, nil
	}
	return nil, false, fmt.Errorf("%w: rank %d: call %d of plan %d is not one of forward (0), backward (1), halos forward (2), halos backward (3)", ErrInvalid, p.g.Rank(), c, p.id)
}

// startable checks that a call of dc's direction and kind may start now.
func (p *Plan) startable(dc *dirCall, halos bool) error {
	if p.closed {
		return fmt.Errorf("rank %d: %s on plan %d: %w", p.g.Rank(), dc.what, p.id, ErrClosed)
	}
	if halos != p.specs[0].HalosOnly {
		if p.specs[0].HalosOnly {
			return fmt.Errorf("%w: rank %d: plan %d is halos-only: use the halos calls", ErrInvalid, p.g.Rank(), p.id)
		}
		return fmt.Errorf("%w: rank %d: plan %d has a padded output: use forward and backward", ErrInvalid, p.g.Rank(), p.id)
	}
	if dc.inFlight {
		return fmt.Errorf("%w: rank %d: a %s of plan %d is already in flight (wait for it first)", ErrState, p.g.Rank(), dc.what, p.id)
	}
	return p.g.usable()
}

// attempt posts dc's messages on instance in (nil: notes, to and from every
// peer) under the call's number.
func (p *Plan) attempt(dc *dirCall, in *instance) error {
	dc.inst = in
	if in != nil {
		return in.startWith(in.sched(dc.d), dc.ptrs, dc.seq)
	}
	b, err := p.notes(dc)
	if err != nil || b == nil {
		return err
	}
	if err := b.Post(nil, dc.seq); err != nil {
		return p.g.fail(fmt.Errorf("rank %d: %s of plan %d: %w", p.g.Rank(), dc.what, p.id, err))
	}
	return nil
}

// batch is what dc's attempt posted (nil: nothing, a group of one).
func (dc *dirCall) batch() (transport.Batch, []recvInfo) {
	if dc.inst != nil {
		s := dc.inst.sched(dc.d)
		return s.batch, s.recvs
	}
	return dc.note, dc.noteRecvs
}

// settle finishes dc's call, blocking: it completes the exchange once
// every peer ran the same instance, after agreeing with every rank in this
// same call and running it again on the agreed instance if one did not.
func (p *Plan) settle(dc *dirCall) error {
	if dc.ag == nil && !dc.arrived && dc.err == nil && (len(p.g.inflight) == 0 || p.g.quietBut(dc)) {
		// Nothing else in flight needs this rank: the transport's own
		// wait, as if no other call existed, and in the steady state (every
		// peer ran the same instance) the completion, with nothing more.
		if b, _ := dc.batch(); b != nil {
			if err := b.Wait(p.g.opts.Timeout); err != nil {
				p.failed(dc, err)
				return p.finish(dc)
			}
		}
		if same, err := p.judge(dc); same && err == nil {
			dc.inst.complete(dc.inst.sched(dc.d))
			dc.inFlight = false
			if len(p.g.inflight) > 0 {
				p.g.unlist(dc)
			}
			return nil
		}
		dc.arrived = true
	}
	if ready, err := p.progress(dc); ready || err != nil {
		return p.finish(dc)
	}
	if err := p.g.block(dc, func() (bool, error) { return p.progress(dc) }, dc.wait, func() int { return dc.moves }); err != nil && dc.err == nil {
		p.failed(dc, err) // the wire failed under another call
	}
	return p.finish(dc)
}

// progress advances dc's call as far as it goes without blocking, whichever
// call on the group runs it: it tests the attempt's messages and judges
// them, and where a peer ran another instance, posts and advances the
// agreement and then the attempt on the agreed instance. It stops short of
// the completion, which writes the caller's tensors and belongs to the
// caller's own Wait or Test. ready: only the completion is left; err: the
// call has ended (dc.err).
func (p *Plan) progress(dc *dirCall) (ready bool, err error) {
	for dc.err == nil && !dc.ready {
		if dc.ag == nil {
			if !dc.arrived {
				if b, _ := dc.batch(); b != nil {
					done, err := b.Test()
					if err != nil {
						return false, p.failed(dc, err)
					}
					if !done {
						return false, nil
					}
				}
				dc.arrived = true
				dc.moves++
			}
			same, err := p.judge(dc)
			if err != nil {
				return false, p.failed(dc, err)
			}
			if same {
				dc.ready = true
				break
			}
			if dc.inst != nil {
				dc.inst.release(dc.inst.sched(dc.d))
			}
			if dc.agreed {
				return false, p.failed(dc, fmt.Errorf("%w: peers still run another instance after agreeing", ErrInternal))
			}
			during := duringForward
			if dc.d == DirBackward {
				during = duringBackward
			}
			dc.agreed = true
			if dc.ag, err = newAgreement(p, dc.seq, during, func(in *instance) error { return in.check(in.sched(dc.d), dc.ptrs) }); err != nil {
				return false, p.ended(dc, err)
			}
			dc.moves++
		}
		moved := dc.ag.moves
		in, done, err := dc.ag.step()
		dc.moves += dc.ag.moves - moved
		if err != nil {
			dc.ag = nil
			return false, p.ended(dc, err)
		}
		if !done {
			return false, nil
		}
		dc.ag = nil
		if err := p.attempt(dc, in); err != nil {
			return false, p.ended(dc, err)
		}
		dc.arrived = false
		dc.moves++
	}
	return dc.ready, dc.err
}

// wait blocks on what dc's call waits for now, for Group.block when nothing
// else needs this rank; progress then goes on from there.
func (dc *dirCall) wait(timeout time.Duration) error {
	p := dc.p
	if dc.err != nil || dc.ready {
		return nil
	}
	if dc.ag != nil {
		if err := dc.ag.wait(timeout); err != nil {
			dc.ag = nil
			return p.ended(dc, err)
		}
		return nil
	}
	if b, _ := dc.batch(); b != nil && !dc.arrived {
		if err := b.Wait(timeout); err != nil {
			return p.failed(dc, err)
		}
		dc.arrived = true
		dc.moves++
	}
	return nil
}

// finish ends dc's call for its caller: it completes the exchange if it is
// ready, else returns how it ended.
func (p *Plan) finish(dc *dirCall) error {
	err := dc.err
	if err == nil && dc.ready {
		dc.inst.complete(dc.inst.sched(dc.d))
	}
	dc.inFlight, dc.arrived, dc.ready, dc.err = false, false, false, nil
	p.g.unlist(dc)
	return err
}

// ended ends dc's call with err (the wire is fine: a mismatch, a rank that
// could not run the agreed layout); its caller's Wait or Test returns err.
func (p *Plan) ended(dc *dirCall, err error) error {
	if dc.inst != nil && dc.inst.sched(dc.d).inFlight {
		dc.inst.release(dc.inst.sched(dc.d))
	}
	dc.inst = nil
	if dc.err == nil {
		dc.err = fmt.Errorf("%w (in the %s of call %d)", err, dc.what, dc.seq)
	}
	return dc.err
}

// judge reads the tags of what every peer sent in dc's attempt: true if all
// ran the same instance and call as this rank (and each message has the
// length that instance gives it), false if any did not or this rank had no
// instance. A length that the instance cannot explain is the wire's fault.
func (p *Plan) judge(dc *dirCall) (bool, error) {
	if dc.inst == nil {
		return false, nil
	}
	b, recvs := dc.batch()
	want := p.g.tag(dc.inst.ident, dc.phase())
	for _, r := range recvs {
		if tag, _ := b.Received(r.op); tag&^seqMask != want {
			return false, nil
		}
	}
	for _, r := range recvs {
		if _, n := b.Received(r.op); n != r.want {
			return false, fmt.Errorf("%w: rank %d sent %d bytes where the agreed layout gives %d", ErrTransport, r.peer, n, r.want)
		}
	}
	return true, nil
}

// failed ends dc's call on a failure of the wire: the group is unusable.
func (p *Plan) failed(dc *dirCall, err error) error {
	if dc.inst != nil {
		dc.inst.release(dc.inst.sched(dc.d))
	}
	if dc.ag != nil {
		dc.ag.close()
		dc.ag = nil
	}
	dc.inst = nil
	hint := ""
	if errors.Is(err, ErrTimeout) {
		// Ranks in different plans or layouts meet and agree, and every
		// call in flight progresses the others' agreements; what is left
		// to time out is a peer that never made this call.
		hint = fmt.Sprintf(" (collective call %d on this communicator: every rank must make the same exchanges in the same order)", dc.seq)
	}
	if dc.err == nil {
		dc.err = p.g.fail(fmt.Errorf("rank %d: %s of plan %d%s: %w", p.g.Rank(), dc.what, p.id, hint, err))
	}
	return dc.err
}

// Wait finishes the exchange that a start call began, within the group's
// timeout. While it cannot go on, it progresses the other exchanges in
// flight on the group, so that ranks may finish them in any order.
func (p *Plan) Wait(d Direction) error {
	dc, err := p.dir(d)
	if err != nil {
		return err
	}
	if err := p.inFlight(dc); err != nil {
		return err
	}
	return p.settle(dc)
}

// Test progresses the exchange that a start call began without blocking, and
// finishes it if its messages have all arrived and every peer ran the same
// instance; an agreement that a peer's other instance calls for goes on in
// later calls (on any exchange of the group). While it is not done, it
// progresses the other exchanges in flight too, so that a peer waiting for
// one of them is never left waiting on this rank's polling.
func (p *Plan) Test(d Direction) (done bool, err error) {
	dc, err := p.dir(d)
	if err != nil {
		return false, err
	}
	if err := p.inFlight(dc); err != nil {
		return false, err
	}
	if ready, err := p.progress(dc); ready || err != nil {
		return true, p.finish(dc)
	}
	if len(p.g.inflight) > 1 {
		if err := p.g.progressOthers(dc); err != nil {
			p.failed(dc, err)
			return true, p.finish(dc)
		}
	}
	return false, nil
}

// Messages is how many messages with data one exchange of direction d sends
// and receives on the last agreed instance: one per peer and kind, whatever
// the number of layouts (every call also sends an empty message to, and
// receives one from, each other peer).
func (p *Plan) Messages(d Direction) int {
	if p.cur == nil {
		return 0
	}
	return p.cur.sched(d).nmsg
}

// InFlight reports whether an exchange of direction d is started and not yet
// finished.
func (p *Plan) InFlight(d Direction) bool {
	dc, err := p.dir(d)
	return err == nil && dc.inFlight
}

func (p *Plan) inFlight(dc *dirCall) error {
	if !dc.inFlight {
		// Once the group has failed, every later call says so, also a
		// wait after the test that found the failure and ended the call.
		if err := p.g.usable(); err != nil {
			return err
		}
		return fmt.Errorf("%w: rank %d: no %s of plan %d is in flight (start one first)", ErrState, p.g.Rank(), dc.what, p.id)
	}
	return nil
}
