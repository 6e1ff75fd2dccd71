package halo

import "fmt"

// Plan is a halo exchange for one layout, or for several exchanged together
// (one message per peer and direction carries every layout's slabs), made
// once and run every step.
type Plan struct {
	g      *Group
	id     uint32
	specs  []Spec      // one per layout, normalized
	parts  []partition // one per layout, as agreed
	closed bool

	fwd, bwd schedule
}

// MaxLayouts is how many layouts one plan may exchange together.
const MaxLayouts = 16

// NewPlan creates a plan collectively: every rank of the group calls it with
// its own shard, in the same order relative to other plans. The ranks
// exchange their layouts and any disagreement fails creation on all of them.
func (g *Group) NewPlan(spec Spec) (*Plan, error) { return g.NewMultiPlan([]Spec{spec}) }

// NewMultiPlan creates one plan over several layouts (the inputs of several
// convolutions, a tensor and its cache), collectively like NewPlan: each call
// then exchanges every layout's halos, with one message per peer and
// direction. The layouts are all padded or all halos-only; each may have its
// own dtype, shape, dim and halo sizes, and each is agreed on by every rank.
func (g *Group) NewMultiPlan(specs []Spec) (*Plan, error) {
	if err := g.usable(); err != nil {
		return nil, err
	}
	if len(specs) < 1 || len(specs) > MaxLayouts {
		return nil, fmt.Errorf("%w: rank %d: %d layouts, want 1 to %d", ErrInvalid, g.Rank(), len(specs), MaxLayouts)
	}
	p := &Plan{g: g, specs: make([]Spec, len(specs))}
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
	p.id = g.nextPlan
	g.nextPlan++
	lengths, err := p.agree()
	if err != nil {
		return nil, err
	}
	for k, l := range lengths {
		p.parts = append(p.parts, newPartition(l))
		if err := p.parts[k].checkPadding(&p.specs[k]); err != nil {
			return nil, fmt.Errorf("%w: rank %d: plan %d: %s%v", ErrInvalid, g.Rank(), p.id, layoutName(k, len(lengths)), err)
		}
	}
	if err := p.build(); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
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
	for _, s := range []*schedule{&p.fwd, &p.bwd} {
		if s.inFlight {
			p.release(s)
			first = p.g.fail(fmt.Errorf("%w: rank %d: plan %d was destroyed while a %s was in flight; the exchange was cancelled (wait for it before destroying the plan)",
				ErrState, p.g.Rank(), p.id, s.what))
		}
	}
	for _, s := range []*schedule{&p.fwd, &p.bwd} {
		if s.batch != nil {
			if err := s.batch.Close(); err != nil && first == nil {
				first = err
			}
		}
		for _, b := range s.staging {
			if err := b.Free(); err != nil && first == nil {
				first = err
			}
		}
	}
	return first
}

// Rank is the rank of the plan's group this plan runs on.
func (p *Plan) Rank() int { return p.g.Rank() }

// ID is the plan's number within its group (also in its tags).
func (p *Plan) ID() uint32 { return p.id }

// Spec returns the plan's (normalized) layout; the first of a multi-layout
// plan's.
func (p *Plan) Spec() Spec { return p.specs[0] }

// Specs returns every layout of the plan, normalized.
func (p *Plan) Specs() []Spec { return append([]Spec(nil), p.specs...) }

// Lengths are every rank's shard length along dim, as agreed at creation
// (of the first layout).
func (p *Plan) Lengths() []int64 { return append([]int64(nil), p.parts[0].n...) }

// WireBytes is what this rank sends and receives in one forward pass.
func (p *Plan) WireBytes() (sent, received int64) {
	me := p.g.Rank()
	for k, s := range p.specs {
		slice := int64(s.DType.Size())
		for i, n := range s.Shape {
			if i != s.Dim {
				slice *= n
			}
		}
		for _, m := range p.parts[k].outgoing(me, s.Left, s.Right) {
			sent += (m.hi - m.lo) * slice
		}
		for _, m := range p.parts[k].incoming(me, s.Left, s.Right) {
			received += (m.hi - m.lo) * slice
		}
		for _, pc := range p.parts[k].padPieces(s.Left, s.Right, s.Padding) {
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
