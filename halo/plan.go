package halo

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/halo-cp/halo/halo/transport"
)

// Padding says what fills halo slices outside the global sequence: the
// padding modes of torch.nn.Conv3d (see include/halo.h for the gradients'
// order).
type Padding int32

const (
	PadZeros     Padding = 0 // the reference's behaviour
	PadReplicate Padding = 1 // the edge slice repeated
	PadReflect   Padding = 2 // mirrored about the edge slice, which is not repeated
	PadCircular  Padding = 3 // wrapped around the sequence
)

// String is the mode as torch spells padding_mode.
func (p Padding) String() string {
	switch p {
	case PadZeros:
		return "zeros"
	case PadReplicate:
		return "replicate"
	case PadReflect:
		return "reflect"
	case PadCircular:
		return "circular"
	}
	return fmt.Sprintf("padding(%d)", int32(p))
}

// MemoryType says where a layout's tensors live (include/halo.h's
// halo_memory_type_t); the transport's operations carry it.
type MemoryType = transport.Memory

const (
	MemoryHost = transport.Host
	MemoryCUDA = transport.CUDA
)

// Spec is the local layout a plan is made for. Strides are in elements; nil
// means contiguous. The out tensor has x's shape with Left+Right more slices
// along Dim; the gradient tensors have the shapes of out and x.
type Spec struct {
	DType          DType
	Shape          []int64
	XStrides       []int64
	OutStrides     []int64
	GradOutStrides []int64 // nil: same as OutStrides
	GradXStrides   []int64 // nil: same as XStrides
	Dim            int
	Left, Right    int64
	Padding        Padding

	// HalosOnly: the halos go to and come from tensors of their own (left
	// and right, x's shape with Left and Right slices along Dim) instead of
	// a padded out, and backward adds the neighbours' gradients into a
	// grad_x that already holds the rest. The wire does not see the
	// difference: ranks may mix padded and halos-only plans.
	HalosOnly bool
	// Strides of the halos-only tensors; nil means contiguous, the
	// gradients' nil means the same as their tensor's.
	LeftStrides, RightStrides         []int64
	GradLeftStrides, GradRightStrides []int64

	// Memory is where all of the layout's tensors live. A plan over memory
	// the CPU must not touch (CUDA) only moves bytes; see bytesOnly.
	Memory MemoryType
}

// OutShape is the shape of the forward output.
func (s *Spec) OutShape() []int64 {
	o := append([]int64(nil), s.Shape...)
	if s.Dim >= 0 && s.Dim < len(o) {
		o[s.Dim] += s.Left + s.Right
	}
	return o
}

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

// layoutName prefixes messages about layout k of a plan of n layouts.
func layoutName(k, n int) string {
	if n == 1 {
		return ""
	}
	return fmt.Sprintf("layout %d: ", k)
}

func (s *Spec) validate() error {
	nd := len(s.Shape)
	if nd < 1 || nd > MaxDims {
		return fmt.Errorf("ndim %d is out of range [1, %d]", nd, MaxDims)
	}
	if s.DType.Size() == 0 {
		return fmt.Errorf("unknown dtype %d", int32(s.DType))
	}
	if s.Dim < 0 || s.Dim >= nd {
		return fmt.Errorf("dim %d is out of range for a %d-d tensor", s.Dim, nd)
	}
	if s.Left < 0 || s.Right < 0 {
		return fmt.Errorf("halo sizes must not be negative (left %d, right %d)", s.Left, s.Right)
	}
	if s.Padding < PadZeros || s.Padding > PadCircular {
		return fmt.Errorf("unknown padding %d (want zeros 0, replicate 1, reflect 2 or circular 3)", int32(s.Padding))
	}
	if s.Memory != MemoryHost && s.Memory != MemoryCUDA {
		return fmt.Errorf("unknown memory type %d", int32(s.Memory))
	}
	if s.Memory != MemoryHost && !s.HalosOnly {
		return fmt.Errorf("a plan over %v memory must be halos-only (the interior copy and the padding are the caller's work)", s.Memory)
	}
	if s.Memory != MemoryHost && s.Padding != PadZeros {
		return fmt.Errorf("a plan over %v memory pads with zeros only (the caller fills the slots beyond the sequence), not %v: stage other modes through a host plan", s.Memory, s.Padding)
	}
	for i, n := range s.Shape {
		if n < 0 {
			return fmt.Errorf("shape[%d] = %d is negative", i, n)
		}
	}
	if s.Left > 1<<40 || s.Right > 1<<40 || s.Shape[s.Dim] > 1<<40 {
		return fmt.Errorf("sizes along dim %d are too large (left %d, shard %d, right %d)", s.Dim, s.Left, s.Shape[s.Dim], s.Right)
	}
	type layout struct {
		name     string
		shape    []int64
		strides  []int64
		writable bool
	}
	ls := []layout{{"x", s.Shape, s.XStrides, false}, {"grad_x", s.Shape, s.GradXStrides, true}}
	if s.HalosOnly {
		left, right := s.haloShape(s.Left), s.haloShape(s.Right)
		ls = append(ls, layout{"left", left, s.LeftStrides, true}, layout{"right", right, s.RightStrides, true},
			layout{"grad_left", left, s.GradLeftStrides, false}, layout{"grad_right", right, s.GradRightStrides, false})
	} else {
		out := s.OutShape()
		ls = append(ls, layout{"out", out, s.OutStrides, true}, layout{"grad_out", out, s.GradOutStrides, false})
	}
	for _, l := range ls {
		if l.strides == nil {
			if _, err := extent(l.shape, ContiguousStrides(l.shape), s.DType.Size()); err != nil {
				return fmt.Errorf("%s of shape %v: %v", l.name, l.shape, err)
			}
			continue
		}
		if len(l.strides) != nd {
			return fmt.Errorf("%s has %d strides for %d dims", l.name, len(l.strides), nd)
		}
		if err := checkStrides(l.shape, l.strides, s.DType.Size(), l.writable); err != nil {
			return fmt.Errorf("%s of shape %v: %v", l.name, l.shape, err)
		}
	}
	return nil
}

func (s Spec) normalized() Spec {
	s.Shape = append([]int64(nil), s.Shape...)
	or := func(a, b []int64) []int64 {
		if a == nil {
			return append([]int64(nil), b...)
		}
		return append([]int64(nil), a...)
	}
	s.XStrides = or(s.XStrides, ContiguousStrides(s.Shape))
	s.OutStrides = or(s.OutStrides, ContiguousStrides(s.OutShape()))
	s.GradOutStrides = or(s.GradOutStrides, s.OutStrides)
	s.GradXStrides = or(s.GradXStrides, s.XStrides)
	if s.HalosOnly {
		s.OutStrides, s.GradOutStrides = nil, nil
		s.LeftStrides = or(s.LeftStrides, ContiguousStrides(s.haloShape(s.Left)))
		s.RightStrides = or(s.RightStrides, ContiguousStrides(s.haloShape(s.Right)))
		s.GradLeftStrides = or(s.GradLeftStrides, s.LeftStrides)
		s.GradRightStrides = or(s.GradRightStrides, s.RightStrides)
	}
	return s
}

// Plan metadata record, fixed size so every receive knows its length.
const (
	recordMagic   = 0x4f4c4148 // "HALO"
	recordVersion = 1
	recordSize    = 128
)

type record struct {
	plan        uint32
	layouts     int32 // how many layouts the plan has
	layout      int32 // which of them this is
	dtype       DType
	ndim, dim   int32
	padding     Padding
	left, right int64
	shape       [MaxDims]int64
	memory      MemoryType // at byte 112, zero (host) in records of halo 0.2
	cannotMove  bool       // at byte 116: this rank's transport cannot move memory
}

func (p *Plan) record(k int) record {
	s := &p.specs[k]
	r := record{plan: p.id, layouts: int32(len(p.specs)), layout: int32(k), dtype: s.DType, ndim: int32(len(s.Shape)),
		dim: int32(s.Dim), padding: s.Padding, left: s.Left, right: s.Right, memory: s.Memory,
		cannotMove: !transport.Moves(p.g.t, s.Memory)}
	copy(r.shape[:], s.Shape)
	return r
}

func (r *record) encode(b []byte) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], recordMagic)
	le.PutUint16(b[4:], recordVersion)
	le.PutUint32(b[8:], r.plan)
	le.PutUint32(b[12:], uint32(r.dtype))
	le.PutUint32(b[16:], uint32(r.ndim))
	le.PutUint32(b[20:], uint32(r.dim))
	le.PutUint32(b[24:], uint32(r.padding))
	le.PutUint16(b[28:], uint16(r.layouts))
	le.PutUint16(b[30:], uint16(r.layout))
	le.PutUint64(b[32:], uint64(r.left))
	le.PutUint64(b[40:], uint64(r.right))
	for i, n := range r.shape {
		le.PutUint64(b[48+8*i:], uint64(n))
	}
	le.PutUint32(b[112:], uint32(r.memory))
	if r.cannotMove {
		b[116] = 1
	}
}

func decodeRecord(b []byte) (record, error) {
	le := binary.LittleEndian
	if le.Uint32(b[0:]) != recordMagic || le.Uint16(b[4:]) != recordVersion {
		return record{}, fmt.Errorf("not a halo plan record of version %d (another program or halo version on the wire?)", recordVersion)
	}
	r := record{plan: le.Uint32(b[8:]), dtype: DType(le.Uint32(b[12:])), ndim: int32(le.Uint32(b[16:])),
		dim: int32(le.Uint32(b[20:])), padding: Padding(le.Uint32(b[24:])),
		layouts: int32(le.Uint16(b[28:])), layout: int32(le.Uint16(b[30:])),
		left: int64(le.Uint64(b[32:])), right: int64(le.Uint64(b[40:]))}
	for i := range r.shape {
		r.shape[i] = int64(le.Uint64(b[48+8*i:]))
	}
	r.memory = MemoryType(le.Uint32(b[112:]))
	r.cannotMove = b[116] != 0
	if r.ndim < 1 || r.ndim > MaxDims || r.dim < 0 || r.dim >= r.ndim || r.layouts < 1 || r.layouts > MaxLayouts {
		return record{}, fmt.Errorf("corrupt plan record (ndim %d, dim %d, layouts %d)", r.ndim, r.dim, r.layouts)
	}
	return r, nil
}

// agree sends this rank's records (one per layout) to every other rank,
// receives theirs, and checks that all agree. Every rank sees every record,
// so every rank reports the same disagreement. The message has room for
// MaxLayouts records whatever the plan's count, so that ranks that disagree
// on the count still receive each other's and can say so.
func (p *Plan) agree() ([][]int64, error) {
	g, W, me, K := p.g, p.g.Size(), p.g.Rank(), len(p.specs)
	const msg = MaxLayouts * recordSize
	recs := make([][]record, W)
	recs[me] = make([]record, K)
	for k := range p.specs {
		recs[me][k] = p.record(k)
	}
	if W > 1 {
		buf, err := g.t.Alloc(msg * (W + 1))
		if err != nil {
			return nil, err
		}
		defer buf.Free()
		mine := buf.Bytes()[W*msg:]
		for k := range recs[me] {
			recs[me][k].encode(mine[k*recordSize:])
		}
		var ops []transport.Op
		for q := 0; q < W; q++ {
			if q != me {
				ops = append(ops, transport.Op{Peer: q, Tag: tag(0, phaseSetup),
					Segs: []transport.Segment{{Off: int64(q * msg), Len: msg}}})
			}
		}
		for q := 0; q < W; q++ {
			if q != me {
				ops = append(ops, transport.Op{Peer: q, Tag: tag(0, phaseSetup), Send: true,
					Segs: []transport.Segment{{Off: int64(W * msg), Len: msg}}})
			}
		}
		b, err := g.t.Prepare(ops)
		if err != nil {
			return nil, err
		}
		defer b.Close()
		if err := b.Post([]uintptr{buf.Addr()}); err != nil {
			return nil, g.fail(fmt.Errorf("rank %d: creating plan %d: %w", me, p.id, err))
		}
		if err := b.Wait(g.opts.Timeout); err != nil {
			return nil, g.fail(fmt.Errorf("rank %d: creating plan %d (every rank must create the same plans in the same order): %w", me, p.id, err))
		}
		for q := 0; q < W; q++ {
			if q == me {
				continue
			}
			theirs := buf.Bytes()[q*msg:]
			r, err := decodeRecord(theirs)
			for k := 1; err == nil && k < int(r.layouts); k++ {
				var rk record
				if rk, err = decodeRecord(theirs[k*recordSize:]); err == nil {
					recs[q] = append(recs[q], rk)
				}
			}
			if err != nil {
				return nil, g.fail(fmt.Errorf("%w: rank %d: plan record from rank %d: %v", ErrTransport, me, q, err))
			}
			recs[q] = append([]record{r}, recs[q]...)
		}
	}
	if msg := disagreement(recs); msg != "" {
		return nil, fmt.Errorf("%w on plan %d (seen by rank %d): %s", ErrMismatch, p.id, me, msg)
	}
	var unable []int
	for q := range recs {
		if recs[q][0].cannotMove {
			unable = append(unable, q)
		}
	}
	if len(unable) > 0 {
		// Decided from the records, so every rank fails alike.
		return nil, fmt.Errorf("%w: plan %d (seen by rank %d): the transport of %s cannot move %v memory (its UCX was built without it): "+
			"use a UCX built with CUDA support (HPC-X, or UCX configured --with-cuda) on every rank, or stage the slabs through host memory "+
			"with a host plan (halocp does so itself)", ErrInvalid, p.id, me, rankList(unable), recs[unable[0]][0].memory)
	}
	lengths := make([][]int64, K)
	for k := range lengths {
		lengths[k] = make([]int64, W)
		for q := range recs {
			r := recs[q][k]
			lengths[k][q] = r.shape[r.dim]
		}
	}
	return lengths, nil
}

// disagreement describes every field on which the records differ, naming the
// ranks, or returns "". recs[q] are rank q's records, one per layout.
func disagreement(recs [][]record) string {
	var parts []string
	field := func(name string, val func(rs []record) string) {
		groups := map[string][]int{}
		var order []string
		for q, rs := range recs {
			v := val(rs)
			if _, ok := groups[v]; !ok {
				order = append(order, v)
			}
			groups[v] = append(groups[v], q)
		}
		if len(order) < 2 {
			return
		}
		var vs []string
		for _, v := range order {
			vs = append(vs, fmt.Sprintf("%s on %s", v, rankList(groups[v])))
		}
		parts = append(parts, name+": "+strings.Join(vs, ", "))
	}
	field("plan number (plans created in a different order)", func(rs []record) string { return fmt.Sprint(rs[0].plan) })
	field("number of layouts", func(rs []record) string { return fmt.Sprint(len(rs)) })
	if len(parts) > 0 {
		return strings.Join(parts, "; ")
	}
	n := len(recs[0])
	for k := 0; k < n; k++ {
		at := func(f func(r record) string) func(rs []record) string {
			return func(rs []record) string { return f(rs[k]) }
		}
		pre := layoutName(k, n)
		before := len(parts)
		field(pre+"dtype", at(func(r record) string { return r.dtype.String() }))
		field(pre+"ndim", at(func(r record) string { return fmt.Sprint(r.ndim) }))
		field(pre+"dim", at(func(r record) string { return fmt.Sprint(r.dim) }))
		field(pre+"left halo", at(func(r record) string { return fmt.Sprint(r.left) }))
		field(pre+"right halo", at(func(r record) string { return fmt.Sprint(r.right) }))
		field(pre+"padding", at(func(r record) string { return fmt.Sprint(r.padding) }))
		field(pre+"memory type", at(func(r record) string { return r.memory.String() }))
		if len(parts) == before { // same ndim and dim: compare the other dims
			r0 := recs[0][k]
			for i := 0; i < int(r0.ndim); i++ {
				if i != int(r0.dim) {
					field(fmt.Sprintf("%sshape[%d]", pre, i), at(func(r record) string { return fmt.Sprint(r.shape[i]) }))
				}
			}
		}
	}
	return strings.Join(parts, "; ")
}

// rankList prints ranks compactly: "rank 3", "ranks 0-2, 5".
func rankList(rs []int) string {
	var s []string
	for i := 0; i < len(rs); {
		j := i
		for j+1 < len(rs) && rs[j+1] == rs[j]+1 {
			j++
		}
		if j > i {
			s = append(s, fmt.Sprintf("%d-%d", rs[i], rs[j]))
		} else {
			s = append(s, fmt.Sprint(rs[i]))
		}
		i = j + 1
	}
	if len(rs) == 1 {
		return "rank " + s[0]
	}
	return "ranks " + strings.Join(s, ", ")
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
