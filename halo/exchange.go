package halo

import (
	"fmt"
	"unsafe"
)

// Direction is one of a plan's two exchanges.
type Direction int

const (
	DirForward  Direction = 0
	DirBackward Direction = 1
)

func (p *Plan) schedule(d Direction) (*schedule, error) {
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

const (
	CallForward       Call = iota // x, out
	CallBackward                  // grad_out, grad_x
	CallHalosForward              // x, left, right
	CallHalosBackward             // grad_left, grad_right, grad_x
)

// Do runs call c with the tensors of its blocking form, in that order (t2
// unused by the padded calls); without wait it only starts it (see
// ForwardStart). The named methods below are Do with their call.
func (p *Plan) Do(c Call, wait bool, t0, t1, t2 unsafe.Pointer) error {
	s, halos, err := p.call(c)
	if err != nil {
		return err
	}
	if c == CallHalosBackward {
		t1, t2 = t2, t1 // grad_x is base 1
	}
	if err := p.start(s, halos, t0, t1, t2); err != nil || !wait {
		return err
	}
	return p.wait(s)
}

// DoMulti is Do for a plan of several layouts: each argument holds one
// tensor per layout, in the order the layouts were given to NewMultiPlan.
func (p *Plan) DoMulti(c Call, wait bool, a, b, d []unsafe.Pointer) error {
	s, halos, err := p.call(c)
	if err != nil {
		return err
	}
	if c == CallHalosBackward {
		b, d = d, b
	}
	return p.runMulti(s, halos, a, b, d, wait)
}

func (p *Plan) call(c Call) (*schedule, bool, error) {
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

// Forward fills out = [left halo | x | right halo] along dim. x may be the
// interior of out (same strides, at slice Left): then it is not copied.
func (p *Plan) Forward(x, out unsafe.Pointer) error { return p.Do(CallForward, true, x, out, nil) }

// Backward computes grad_x = interior of grad_out + the gradients of x's
// slices that other ranks used as halo. grad_x may be the interior of
// grad_out (same strides, at slice Left).
func (p *Plan) Backward(gradOut, gradX unsafe.Pointer) error {
	return p.Do(CallBackward, true, gradOut, gradX, nil)
}

// HalosForward fills the halos-only plan's left and right tensors with the
// slices before and after x in the global sequence.
func (p *Plan) HalosForward(x, left, right unsafe.Pointer) error {
	return p.Do(CallHalosForward, true, x, left, right)
}

// HalosBackward sends the halo gradients and adds the neighbours' gradients
// of x's slices into gradX, which holds the rest of x's gradient already.
func (p *Plan) HalosBackward(gradLeft, gradRight, gradX unsafe.Pointer) error {
	return p.Do(CallHalosBackward, true, gradLeft, gradRight, gradX)
}

// ForwardStart, BackwardStart, HalosForwardStart and HalosBackwardStart
// begin the exchange of their blocking call and return once its messages are
// posted and the local work that needs nothing from the wire is done; Test or
// Wait finishes it. One exchange per direction may be in flight; the caller's
// tensors belong to it until it completes.
func (p *Plan) ForwardStart(x, out unsafe.Pointer) error {
	return p.Do(CallForward, false, x, out, nil)
}

func (p *Plan) BackwardStart(gradOut, gradX unsafe.Pointer) error {
	return p.Do(CallBackward, false, gradOut, gradX, nil)
}

func (p *Plan) HalosForwardStart(x, left, right unsafe.Pointer) error {
	return p.Do(CallHalosForward, false, x, left, right)
}

func (p *Plan) HalosBackwardStart(gradLeft, gradRight, gradX unsafe.Pointer) error {
	return p.Do(CallHalosBackward, false, gradLeft, gradRight, gradX)
}

// Wait finishes the exchange that a start call began, within the group's timeout.
func (p *Plan) Wait(d Direction) error {
	s, err := p.schedule(d)
	if err != nil {
		return err
	}
	return p.wait(s)
}

// Test progresses the exchange that a start call began without blocking, and
// finishes it if its messages have all arrived.
func (p *Plan) Test(d Direction) (done bool, err error) {
	s, err := p.schedule(d)
	if err != nil {
		return false, err
	}
	if err := p.inFlight(s); err != nil {
		return false, err
	}
	if s.batch != nil {
		done, err := s.batch.Test()
		if err != nil {
			return true, p.failed(s, err)
		}
		if !done {
			return false, nil
		}
	}
	p.complete(s)
	return true, nil
}

// Messages is how many messages one exchange of direction d sends and
// receives: one per peer and kind, whatever the number of layouts.
func (p *Plan) Messages(d Direction) int {
	s, err := p.schedule(d)
	if err != nil {
		return 0
	}
	return s.nmsg
}

// InFlight reports whether an exchange of direction d is started and not yet
// finished.
func (p *Plan) InFlight(d Direction) bool {
	s, err := p.schedule(d)
	return err == nil && s.inFlight
}

// The multi-layout calls take one tensor per layout in each argument, in the
// order of the layouts given to NewMultiPlan; otherwise they are the calls
// above.
func (p *Plan) ForwardMulti(xs, outs []unsafe.Pointer) error {
	return p.DoMulti(CallForward, true, xs, outs, nil)
}

func (p *Plan) BackwardMulti(gradOuts, gradXs []unsafe.Pointer) error {
	return p.DoMulti(CallBackward, true, gradOuts, gradXs, nil)
}

func (p *Plan) HalosForwardMulti(xs, lefts, rights []unsafe.Pointer) error {
	return p.DoMulti(CallHalosForward, true, xs, lefts, rights)
}

func (p *Plan) HalosBackwardMulti(gradLefts, gradRights, gradXs []unsafe.Pointer) error {
	return p.DoMulti(CallHalosBackward, true, gradLefts, gradRights, gradXs)
}

func (p *Plan) ForwardMultiStart(xs, outs []unsafe.Pointer) error {
	return p.DoMulti(CallForward, false, xs, outs, nil)
}

func (p *Plan) BackwardMultiStart(gradOuts, gradXs []unsafe.Pointer) error {
	return p.DoMulti(CallBackward, false, gradOuts, gradXs, nil)
}

func (p *Plan) HalosForwardMultiStart(xs, lefts, rights []unsafe.Pointer) error {
	return p.DoMulti(CallHalosForward, false, xs, lefts, rights)
}

func (p *Plan) HalosBackwardMultiStart(gradLefts, gradRights, gradXs []unsafe.Pointer) error {
	return p.DoMulti(CallHalosBackward, false, gradLefts, gradRights, gradXs)
}

// runMulti starts (and with wait, finishes) s with per-layout tensors: a, b
// and c are the layouts' bases 0, 1 and 2.
func (p *Plan) runMulti(s *schedule, halos bool, a, b, c []unsafe.Pointer, wait bool) error {
	if err := p.startable(s, halos); err != nil {
		return err
	}
	K, per := len(p.specs), s.fixed/len(p.specs)
	for _, arg := range [][]unsafe.Pointer{a, b, c}[:per] {
		if len(arg) != K {
			return fmt.Errorf("%w: rank %d: %s of plan %d: %d tensors for %d layouts", ErrInvalid, p.g.Rank(), s.what, p.id, len(arg), K)
		}
	}
	for k := 0; k < K; k++ {
		s.args[per*k], s.args[per*k+1] = a[k], b[k]
		if per == 3 {
			s.args[per*k+2] = c[k]
		}
	}
	if err := p.startWith(s, s.args); err != nil {
		return err
	}
	if !wait {
		return nil
	}
	return p.wait(s)
}

// start begins one direction: it checks the pointers, packs the outgoing
// slabs, posts every message, and then does the local work that needs
// nothing from the wire (padding, the interior, the edge ranks' +0) while
// the messages travel.
func (p *Plan) start(s *schedule, halos bool, t0, t1, t2 unsafe.Pointer) error {
	if err := p.startable(s, halos); err != nil {
		return err
	}
	if len(p.specs) != 1 {
		return fmt.Errorf("%w: rank %d: plan %d has %d layouts: pass one tensor per layout (the multi calls)", ErrInvalid, p.g.Rank(), p.id, len(p.specs))
	}
	ptrs := [3]unsafe.Pointer{t0, t1, t2}
	return p.startWith(s, ptrs[:s.fixed])
}

// startable checks that s may start now, with calls of the plan's kind.
func (p *Plan) startable(s *schedule, halos bool) error {
	me := p.g.Rank()
	if p.closed {
		return fmt.Errorf("rank %d: %s on plan %d: %w", me, s.what, p.id, ErrClosed)
	}
	if halos != p.specs[0].HalosOnly {
		if p.specs[0].HalosOnly {
			return fmt.Errorf("%w: rank %d: plan %d is halos-only: use the halos calls", ErrInvalid, me, p.id)
		}
		return fmt.Errorf("%w: rank %d: plan %d has a padded output: use forward and backward", ErrInvalid, me, p.id)
	}
	if s.inFlight {
		return fmt.Errorf("%w: rank %d: a %s of plan %d is already in flight (wait for it first)", ErrState, me, s.what, p.id)
	}
	return p.g.usable()
}

// startWith starts s with the fixed bases given (every layout's, in order).
func (p *Plan) startWith(s *schedule, ptrs []unsafe.Pointer) error {
	me := p.g.Rank()
	for i, name := range s.names {
		if ptrs[i] == nil && s.ext[i] > 0 {
			return fmt.Errorf("%w: rank %d: %s of plan %d: %s is NULL", ErrInvalid, me, s.what, p.id, name)
		}
	}
	if err := p.aliasing(s, ptrs); err != nil {
		return fmt.Errorf("%w: rank %d: %s of plan %d: %v", ErrInvalid, me, s.what, p.id, err)
	}
	for i := 0; i < s.fixed; i++ {
		s.ptrs[i], s.bases[i] = ptrs[i], uintptr(ptrs[i])
	}
	x := p.g.exec
	for i := range s.pack {
		l := &s.pack[i]
		x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
	}
	if s.batch != nil {
		if err := s.batch.Post(s.bases); err != nil {
			return p.g.fail(fmt.Errorf("rank %d: %s of plan %d: %w", me, s.what, p.id, err))
		}
	}
	for i := range s.zero {
		l := &s.zero[i]
		x.zero(&l.w, l.elem, s.ptrs[l.dst])
	}
	for i := range s.fill {
		l := &s.fill[i]
		x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
	}
	for i := range s.copyIn {
		if l := &s.copyIn[i]; !s.aliased[l.layout] {
			x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
		}
	}
	for i := range s.addZero {
		l := &s.addZero[i]
		x.addZero(&l.w, l.dt, s.ptrs[l.dst])
	}
	s.inFlight = true
	return nil
}

func (p *Plan) inFlight(s *schedule) error {
	if !s.inFlight {
		return fmt.Errorf("%w: rank %d: no %s of plan %d is in flight (start one first)", ErrState, p.g.Rank(), s.what, p.id)
	}
	return nil
}

// wait blocks until the messages of the direction start began have arrived,
// then completes it.
func (p *Plan) wait(s *schedule) error {
	if err := p.inFlight(s); err != nil {
		return err
	}
	if s.batch != nil {
		if err := s.batch.Wait(p.g.opts.Timeout); err != nil {
			return p.failed(s, err)
		}
	}
	p.complete(s)
	return nil
}

// complete unpacks and adds what arrived, in the order of the output.
func (p *Plan) complete(s *schedule) {
	x := p.g.exec
	for i := range s.unpack {
		l := &s.unpack[i]
		x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
	}
	for i := range s.add {
		l := &s.add[i]
		x.add(&l.w, l.dt, s.ptrs[l.dst], s.ptrs[l.src])
	}
	for i := range s.combine {
		if l := &s.combine[i]; l.add {
			x.add(&l.w, l.dt, s.ptrs[l.dst], s.ptrs[l.src])
		} else {
			x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
		}
	}
	p.release(s)
}

// failed ends an exchange whose messages failed: the group is unusable.
func (p *Plan) failed(s *schedule, err error) error {
	p.release(s)
	return p.g.fail(fmt.Errorf("rank %d: %s of plan %d: %w", p.g.Rank(), s.what, p.id, err))
}

// release forgets the caller's tensors: the exchange no longer owns them.
func (p *Plan) release(s *schedule) {
	for i := 0; i < s.fixed; i++ {
		s.ptrs[i], s.bases[i] = nil, 0
	}
	s.inFlight = false
}

// aliasing finds the padded layouts whose unpadded tensor is exactly the
// interior of the padded one (s.aliased), and refuses any other overlap
// between the caller's tensors (it would be silent garbage).
func (p *Plan) aliasing(s *schedule, ptrs []unsafe.Pointer) error {
	for k, a := range s.alias {
		inner, outer := uintptr(ptrs[a.inner]), uintptr(ptrs[a.outer])
		s.aliased[k] = s.ext[a.inner] > 0 && s.ext[a.outer] > 0 && a.off >= 0 && inner == outer+uintptr(a.off)
	}
	for i := range ptrs {
		for j := i + 1; j < len(ptrs); j++ {
			a, b := uintptr(ptrs[i]), uintptr(ptrs[j])
			if s.ext[i] == 0 || s.ext[j] == 0 || a >= b+uintptr(s.ext[j]) || b >= a+uintptr(s.ext[i]) {
				continue
			}
			if p.pairAliased(s, i, j) {
				continue
			}
			if k, ok := p.aliasPair(s, i, j); ok {
				spec := &p.specs[k]
				inner, outer := s.names[s.alias[k].inner], s.names[s.alias[k].outer]
				return fmt.Errorf("%s overlaps %s but is not its interior (it must be %s narrowed to slices [%d, %d) along dim %d with the same strides, or not overlap it)",
					inner, outer, outer, spec.Left, spec.Left+spec.Shape[spec.Dim], spec.Dim)
			}
			return fmt.Errorf("%s and %s overlap in memory", s.names[i], s.names[j])
		}
	}
	return nil
}

// aliasPair returns the layout whose inner and outer bases are i and j.
func (p *Plan) aliasPair(s *schedule, i, j int) (int, bool) {
	for k, a := range s.alias {
		if (a.inner == i && a.outer == j) || (a.inner == j && a.outer == i) {
			return k, true
		}
	}
	return 0, false
}

// pairAliased says whether bases i and j are a layout's tensors found to
// alias exactly.
func (p *Plan) pairAliased(s *schedule, i, j int) bool {
	k, ok := p.aliasPair(s, i, j)
	return ok && s.aliased[k]
}
