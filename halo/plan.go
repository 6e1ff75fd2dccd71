package halo

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

// Plan is a halo exchange for one layout, or for several exchanged together
// (one message per peer and direction carries every layout's slabs), made
// once and run every step.
//
// A rank gives its plan its own shard's layout; what runs is an instance:
// the layout as every rank agreed on it (with every rank's shard length)
// and its prepared messages. The identity of the instance rides in every
// message of every call, so ranks that come to a call with different
// instances (a peer's shard changed length, a peer's plan is new) find out
// from that call's messages, agree again within the same call and run it
// on the new instance. A plan keeps its last few instances for layouts that
// come round again. Nothing a rank sees alone decides what the ranks run.
type Plan struct {
	g        *Group
	id       uint32 // this rank's handle number, for messages
	specs    []Spec // one per layout, normalized
	closed   bool
	cur      *instance   // what the next call tries first; nil before any agreement
	kept     []*instance // agreed instances, most recently used first
	fwd, bwd dirCall
}

// dirCall is one direction's call on a plan, from its start to its end.
type dirCall struct {
	p         *Plan
	d         Direction
	what      string
	inFlight  bool // started and not yet finished by a Wait or Test of the caller
	halos     bool
	seq       uint64              // the call's number (see Group.tag)
	args      [3][]unsafe.Pointer // the caller's tensors: per argument, one per layout
	ptrs      []unsafe.Pointer    // the same as an instance's fixed bases
	inst      *instance           // what the attempt runs; nil: notes only (no agreed instance)
	agreed    bool                // the call has agreed once (a second disagreement is a bug)
	note      transport.Batch     // see Plan.notes
	noteRecvs []recvInfo

	// Where the call stands (progress), the same whichever call moved it:
	arrived bool       // the attempt's messages have all come
	ready   bool       // and every peer ran the same instance: only the local completion is left
	ag      *agreement // the agreement in progress after an attempt that differed
	err     error      // the call ended with this; its caller's Wait or Test returns it
	moves   int        // stages passed, for Group.block's deadline
}

func (dc *dirCall) phase() int {
	if dc.d == DirBackward {
		return phaseBackward
	}
	return phaseForward
}

// keptInstances bounds the instances a plan keeps: each holds staging
// memory and prepared transport operations.
const keptInstances = 4

// MaxLayouts is how many layouts one plan may exchange together.
const MaxLayouts = 16

// NewPlan creates a plan collectively: every rank of the group calls it with
// its own shard, in the same order relative to its other collective calls
// (plan creations and exchanges). The ranks exchange their layouts and any
// disagreement fails creation on all of them, as does a rank that cannot
// make its part: creation ends alike on every rank.
func (g *Group) NewPlan(spec Spec) (*Plan, error) { return g.NewMultiPlan([]Spec{spec}) }

// NewMultiPlan creates one plan over several layouts (the inputs of several
// convolutions, a tensor and its cache), collectively like NewPlan: each call
// then exchanges every layout's halos, with one message per peer and
// direction. The layouts are all padded or all halos-only; each may have its
// own dtype, shape, dim and halo sizes, and each is agreed on by every rank.
func (g *Group) NewMultiPlan(specs []Spec) (*Plan, error) {
	p, err := g.newPlan(specs)
	if err != nil {
		return nil, err
	}
	a, err := newAgreement(p, g.nextSeq(), duringCreate, nil)
	if err == nil {
		_, err = a.run()
	}
	if err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// NewDeferredPlan makes a plan without meeting the other ranks: it checks
// the layouts locally, and the first call agrees with the others (as every
// call does when ranks run different instances). A rank may so make a plan
// whenever it meets a layout it has no plan for, whatever the other ranks
// hold: the cache of a binding, where one rank's shape may repeat while
// another's is new.
func (g *Group) NewDeferredPlan(specs []Spec) (*Plan, error) { return g.newPlan(specs) }

func (g *Group) newPlan(specs []Spec) (*Plan, error) {
	if err := g.usable(); err != nil {
		return nil, err
	}
	if len(specs) < 1 || len(specs) > MaxLayouts {
		return nil, fmt.Errorf("%w: rank %d: %d layouts, want 1 to %d", ErrInvalid, g.Rank(), len(specs), MaxLayouts)
	}
	p := &Plan{g: g, id: g.nextPlan, specs: make([]Spec, len(specs))}
	g.nextPlan++
	for k, spec := range specs {
		if err := spec.validate(); err != nil {
			return nil, fmt.Errorf("%w: rank %d: %s%v", ErrInvalid, g.Rank(), layoutName(k, len(specs)), err)
		}
		if spec.Memory != specs[0].Memory {
			return nil, fmt.Errorf("%w: rank %d: layout %d is in %v memory, layout 0 in %v: the layouts of one plan share one memory type",
				ErrInvalid, g.Rank(), k, spec.Memory, specs[0].Memory)
		}
		if spec.HalosOnly != specs[0].HalosOnly {
			return nil, fmt.Errorf("%w: rank %d: layout %d is %s, layout 0 is not: the layouts of one plan are all padded or all halos-only",
				ErrInvalid, g.Rank(), k, map[bool]string{true: "halos-only", false: "padded"}[spec.HalosOnly])
		}
		p.specs[k] = spec.normalized()
	}
	per := 2
	if p.specs[0].HalosOnly {
		per = 3
	}
	for _, dc := range []*dirCall{&p.fwd, &p.bwd} {
		for j := range dc.args {
			dc.args[j] = make([]unsafe.Pointer, len(specs))
		}
		dc.ptrs = make([]unsafe.Pointer, per*len(specs))
	}
	p.fwd.p, p.fwd.d, p.fwd.what = p, DirForward, "forward"
	p.bwd.p, p.bwd.d, p.bwd.what = p, DirBackward, "backward"
	return p, nil
}

// newInstance builds the instance of the agreed lengths (per layout, per
// rank). It is local: its errors are made common by agree.
func (p *Plan) newInstance(ident uint64, lengths [][]int64) (*instance, error) {
	in := &instance{g: p.g, id: p.id, ident: ident, specs: p.specs, exec: newExecutor(p.specs[0].Memory, &p.g.opts)}
	for k, l := range lengths {
		in.parts = append(in.parts, newPartition(l))
		if err := in.parts[k].checkPadding(&in.specs[k]); err != nil {
			return nil, fmt.Errorf("%w: rank %d: plan %d: %s%v", ErrInvalid, p.g.Rank(), p.id, layoutName(k, len(lengths)), err)
		}
	}
	if err := in.build(); err != nil {
		in.close()
		return nil, err
	}
	return in, nil
}

// find returns the kept instance with identity ident, or nil.
func (p *Plan) find(ident uint64) *instance {
	for _, in := range p.kept {
		if in.ident == ident {
			return in
		}
	}
	return nil
}

// use makes in the instance the next call tries, keeping the most recent
// few; an instance an exchange in flight still runs is never dropped.
func (p *Plan) use(in *instance) {
	p.cur = in
	p.kept = slices.DeleteFunc(p.kept, func(x *instance) bool { return x == in })
	p.kept = slices.Insert(p.kept, 0, in)
	for i := len(p.kept) - 1; i >= keptInstances; i-- {
		if x := p.kept[i]; x != p.fwd.inst && x != p.bwd.inst {
			x.close()
			p.kept = slices.Delete(p.kept, i, i+1)
		}
	}
}

// Close releases the plan's transport resources; it is safe to call twice.
// Closing a plan with an exchange in flight cancels it: that is an error,
// and the group is unusable afterwards (its peers' messages are cut short).
func (p *Plan) Close() error {
	if p.closed {
		return nil
	}
	p.closed = true
	var first error
	for _, dc := range []*dirCall{&p.fwd, &p.bwd} {
		// A call that has already ended (its caller has not heard) leaves
		// nothing on the wire; one still going cuts its peers' short.
		if dc.inFlight && dc.err == nil {
			if dc.inst != nil {
				dc.inst.release(dc.inst.sched(dc.d))
			}
			if dc.ag != nil {
				dc.ag.close()
				dc.ag = nil
			}
			first = p.g.fail(fmt.Errorf("%w: rank %d: plan %d was destroyed while a %s was in flight; the exchange was cancelled (wait for it before destroying the plan)",
				ErrState, p.g.Rank(), p.id, dc.what))
		}
		if dc.inFlight {
			dc.inFlight, dc.arrived, dc.ready, dc.err = false, false, false, nil
			p.g.unlist(dc)
		}
		if dc.note != nil {
			if err := dc.note.Close(); err != nil && first == nil {
				first = err
			}
		}
	}
	for _, in := range p.kept {
		if err := in.close(); err != nil && first == nil {
			first = err
		}
	}
	p.kept, p.cur = nil, nil
	return first
}

// Rank is the rank of the plan's group this plan runs on.
func (p *Plan) Rank() int { return p.g.Rank() }

// ID is the plan's number on this rank (in its messages).
func (p *Plan) ID() uint32 { return p.id }

// Spec returns the plan's (normalized) layout; the first of a multi-layout
// plan's.
func (p *Plan) Spec() Spec { return p.specs[0] }

// Specs returns every layout of the plan, normalized.
func (p *Plan) Specs() []Spec { return append([]Spec(nil), p.specs...) }

// Lengths are every rank's shard length along dim (of the first layout) as
// last agreed, or nil before the first agreement of a deferred plan.
func (p *Plan) Lengths() []int64 {
	if p.cur == nil {
		return nil
	}
	return append([]int64(nil), p.cur.parts[0].n...)
}

// WireBytes is what this rank sends and receives in one forward pass of the
// last agreed instance.
func (p *Plan) WireBytes() (sent, received int64) {
	if p.cur == nil {
		return 0, 0
	}
	me := p.g.Rank()
	for k, s := range p.cur.specs {
		slice := int64(s.DType.Size())
		for i, n := range s.Shape {
			if i != s.Dim {
				slice *= n
			}
		}
		part := p.cur.parts[k]
		for _, m := range part.outgoing(me, s.Left, s.Right) {
			sent += (m.hi - m.lo) * slice
		}
		for _, m := range part.incoming(me, s.Left, s.Right) {
			received += (m.hi - m.lo) * slice
		}
		for _, pc := range part.padPieces(s.Left, s.Right, s.Padding) {
			lo, hi := pc.sources()
			if pc.owner == me && pc.dst != me {
				sent += (hi - lo) * slice
			} else if pc.dst == me && pc.owner != me {
				received += (hi - lo) * slice
			}
		}
	}
	return
}

// notes returns dc's batch of empty messages, one to and one from every
// other rank, for a call with no agreed instance: its peers learn from it
// that this rank must agree first. Made on first need.
func (p *Plan) notes(dc *dirCall) (transport.Batch, error) {
	if dc.note != nil || p.g.Size() == 1 {
		return dc.note, nil
	}
	var l opList
	l.dense(p.g.Rank(), p.g.Size(), p.g.tag(identNone, dc.phase()))
	b, err := p.g.t.Prepare(l.ops)
	if err != nil {
		return nil, fmt.Errorf("rank %d: preparing plan %d: %w", p.g.Rank(), p.id, err)
	}
	dc.note = b
	dc.noteRecvs = dc.noteRecvs[:0]
	for i, op := range l.ops {
		if !op.Send {
			dc.noteRecvs = append(dc.noteRecvs, recvInfo{op: i, peer: op.Peer})
		}
	}
	return b, nil
}
