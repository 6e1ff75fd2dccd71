package halo

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

// schedule is one direction's prepared work, plain data: the messages (one
// batch) and the local operations around them. Its bases are the caller's
// tensors first (per layout: 2 for a padded plan, 3 for a halos-only one;
// layout k's at k*per), then one per staging buffer.
//
//	padded forward:      0 x          1 out     (x may be out's interior)
//	padded backward:     0 grad_out   1 grad_x  (grad_x may be grad_out's interior)
//	halos-only forward:  0 x          1 left    2 right
//	halos-only backward: 0 grad_left  1 grad_x  2 grad_right (grad_x is added to)
type schedule struct {
	what    string   // "forward" or "backward", for messages
	names   []string // of the fixed bases
	ext     []int64  // byte extents of the fixed bases, for the pointer checks
	fixed   int
	nmsg    int // messages with data per exchange (one per peer and kind)
	batch   transport.Batch
	recvs   []recvInfo       // the batch's receives
	args    []unsafe.Pointer // scratch for the multi calls' tensors, fixed long
	bases   []uintptr        // what the batch is posted with
	ptrs    []unsafe.Pointer // the same, for the local work
	staging []transport.Buffer
	pack    []local // before Post: staging <- source
	zero    []local // destination slices outside the sequence (forward, zeros padding)
	fill    []local // destination slices outside the sequence from our own slices (forward, other padding)
	addZero []local // destination slices the reference adds zeros to (backward, edge ranks)
	copyIn  []local // the interiors, unless the caller aliased them
	unpack  []local // after the wait: destination <- staging
	add     []local // after the wait, in order: destination += staging
	combine []local // then, in order: the padding slots' gradients (padding.go)

	// A padded layout's unpadded tensor may be the padded one's interior:
	// then it is not copied. One entry per layout of a padded plan.
	aliases []innerAlias
	aliased []bool // per entry of aliases, set by start: skip that layout's copyIn

	inFlight bool // between start and the wait or test that completes it
}

// Direction is one of a plan's two exchanges, each with its schedule.
type Direction int

const (
	DirForward  Direction = 0
	DirBackward Direction = 1
)

// recvInfo is one receive of a batch: its index among the batch's
// operations, its peer, and the bytes it expects.
type recvInfo struct {
	op, peer int
	want     int64
}

// innerAlias says where a padded layout's unpadded tensor (base inner) would be
// the padded one's (base outer) interior: at byte offset off, or never (-1).
type innerAlias struct {
	inner, outer int
	off          int64
}

// local is one walk of local work over bases of the schedule: dst is
// operand 0 of the walk, src (or -1) operand 1; elem and dt are the
// layout's. layout indexes the schedule's aliases (copyIn only).
type local struct {
	w        walk
	dst, src int
	elem     int
	dt       DType
	layout   int
	add      bool // combine only: add rather than copy
}

// region is where a range of slices of a layout's padded tensor
// [left | x | right] lives: in which base, with which shape and strides,
// from which slice.
type region struct {
	base    int
	shape   []int64
	strides []int64
	first   int64 // the padded slice that is slice 0 of this tensor
}

// layoutBuilder is one layout of an instance as its schedules are built: its
// work goes into the instance's two schedules, its fixed bases from base0.
type layoutBuilder struct {
	inst  *instance
	k     int
	base0 int
	spec  *Spec
	part  partition
	elem  int
}

// build prepares both directions from the agreed partitions. Each layout
// contributes its slabs; the slabs for one peer in one direction travel as
// one message, in layout order on both sides.
func (in *instance) build() error {
	me := in.g.Rank()
	f, b := &in.fwd, &in.bwd
	f.what, b.what = "forward", "backward"
	per := 2
	if in.specs[0].HalosOnly {
		per = 3
	}
	f.fixed, b.fixed = per*len(in.specs), per*len(in.specs)
	f.ext, b.ext = make([]int64, f.fixed), make([]int64, b.fixed)
	var fops, bops opList
	for k := range in.specs {
		l := layoutBuilder{inst: in, k: k, base0: per * k, spec: &in.specs[k], part: in.parts[k], elem: in.specs[k].DType.Size()}
		if err := l.build(&fops, &bops); err != nil {
			return err
		}
	}
	f.nmsg, b.nmsg = len(fops.ops), len(bops.ops)
	fops.dense(me, in.g.Size(), in.g.tag(in.ident, phaseForward))
	bops.dense(me, in.g.Size(), in.g.tag(in.ident, phaseBackward))
	for _, sc := range []struct {
		s   *schedule
		ops []transport.Op
	}{{f, fops.ops}, {b, bops.ops}} {
		sc.s.aliased = make([]bool, len(sc.s.aliases))
		sc.s.args = make([]unsafe.Pointer, sc.s.fixed)
		sc.s.bases = make([]uintptr, sc.s.fixed+len(sc.s.staging))
		sc.s.ptrs = make([]unsafe.Pointer, len(sc.s.bases))
		for i, buf := range sc.s.staging {
			sc.s.bases[sc.s.fixed+i] = buf.Addr()
			sc.s.ptrs[sc.s.fixed+i] = unsafe.Pointer(unsafe.SliceData(buf.Bytes()))
		}
		for i, op := range sc.ops {
			if !op.Send {
				sc.s.recvs = append(sc.s.recvs, recvInfo{op: i, peer: op.Peer, want: op.Bytes()})
			}
		}
		if len(sc.ops) > 0 {
			batch, err := in.g.t.Prepare(sc.ops)
			if err != nil {
				return fmt.Errorf("rank %d: preparing plan %d: %w", me, in.id, err)
			}
			sc.s.batch = batch
		}
	}
	return nil
}

// opList merges operations with the same peer and kind (send or receive)
// into one message: their segments in the order they were added.
type opList struct {
	ops []transport.Op
}

// dense completes the list to exactly one send to and one receive from
// every other rank (empty where no slab travels) and makes every receive
// loose on the call's number: each rank then hears from every peer in
// every call, and learns from the tag whether that peer runs the same
// agreed layout (see Group.tag). Without the empty messages a rank whose
// neighbours all agree could finish while a far rank waits for it to
// re-plan.
func (l *opList) dense(me, size int, tag uint64) {
	for q := 0; q < size; q++ {
		if q == me {
			continue
		}
		for _, send := range []bool{false, true} {
			if !slices.ContainsFunc(l.ops, func(o transport.Op) bool { return o.Peer == q && o.Send == send }) {
				l.ops = append(l.ops, transport.Op{Peer: q, Tag: tag, Send: send})
			}
		}
	}
	for i := range l.ops {
		if !l.ops[i].Send {
			l.ops[i].Match = seqMask
		}
	}
}

func (l *opList) add(op *transport.Op) {
	if op == nil {
		return
	}
	for i := range l.ops {
		if o := &l.ops[i]; o.Peer == op.Peer && o.Send == op.Send && o.Tag == op.Tag {
			o.Segs = append(o.Segs, op.Segs...)
			return
		}
	}
	l.ops = append(l.ops, *op)
}

// build adds layout l's work to both schedules.
func (l layoutBuilder) build(fops, bops *opList) error {
	s, me := l.spec, l.inst.g.Rank()
	L, R, n := s.Left, s.Right, s.Shape[s.Dim]
	off := l.part.off[me]
	in := l.part.incoming(me, L, R)
	out := l.part.outgoing(me, L, R)
	padL, padR := l.part.padding(me, L, R)
	ftag, btag := l.tags()
	f, b := &l.inst.fwd, &l.inst.bwd
	K := len(l.inst.specs)

	// Where the halo sides and the interior live, per direction.
	var fside, bside [2]region
	var fmid, bmid region
	name := func(n string) string {
		if K == 1 {
			return n
		}
		return fmt.Sprintf("%s[%d]", n, l.k)
	}
	if s.HalosOnly {
		left, right := s.haloShape(L), s.haloShape(R)
		f.names = append(f.names, name("x"), name("left"), name("right"))
		b.names = append(b.names, name("grad_left"), name("grad_x"), name("grad_right"))
		fside = [2]region{{l.base0 + 1, left, s.LeftStrides, 0}, {l.base0 + 2, right, s.RightStrides, L + n}}
		bside = [2]region{{l.base0, left, s.GradLeftStrides, 0}, {l.base0 + 2, right, s.GradRightStrides, L + n}}
	} else {
		o := s.OutShape()
		f.names = append(f.names, name("x"), name("out"))
		b.names = append(b.names, name("grad_out"), name("grad_x"))
		fmid, bmid = region{l.base0 + 1, o, s.OutStrides, 0}, region{l.base0, o, s.GradOutStrides, 0}
		fside = [2]region{fmid, fmid}
		bside = [2]region{bmid, bmid}
	}
	xr := region{l.base0, s.Shape, s.XStrides, L}
	gxr := region{l.base0 + 1, s.Shape, s.GradXStrides, L}
	for _, r := range []region{xr, fside[0], fside[1]} {
		f.ext[r.base], _ = extent(r.shape, r.strides, l.elem)
	}
	for _, r := range []region{bside[0], gxr, bside[1]} {
		b.ext[r.base], _ = extent(r.shape, r.strides, l.elem)
	}

	// Forward: receive the halos, send x's boundary slabs, zero the slices
	// outside the sequence, copy the interior of a padded out.
	for _, m := range in {
		op, err := l.recvOp(f, fside[m.side], m.lo-off+L, m.hi-off+L, m.src, ftag, false)
		if err != nil {
			return err
		}
		fops.add(op)
	}
	for _, m := range out {
		op, err := l.sendOp(f, xr, m.lo-off+L, m.hi-off+L, m.dst, ftag)
		if err != nil {
			return err
		}
		fops.add(op)
	}
	if err := l.inst.exec.admit(l.part, L, R); err != nil {
		return fmt.Errorf("%w: rank %d: plan %d: %v", ErrInvalid, me, l.inst.id, err)
	}
	for side, r := range [][2]int64{{0, padL}, {L + n + R - padR, L + n + R}} {
		if r[0] < r[1] && s.Padding == PadZeros {
			f.zero = append(f.zero, l.oneOperand(fside[side], r[0], r[1]))
		}
	}
	if !s.HalosOnly {
		f.copyIn = append(f.copyIn, l.twoOperands(fmid, xr, L, L+n, len(f.aliases)))
		f.aliases = append(f.aliases, innerAlias{xr.base, fmid.base, l.aliasOffset(s.XStrides, s.OutStrides)})
	}

	// Backward: gradients of our slices come back from the ranks we sent
	// them to, and are added in the order of `out`. Edge ranks add +0 where
	// the reference adds its zero tensor; x+0 commutes bitwise with the
	// other additions (it only turns -0 into +0 and quiets NaNs), so that
	// pass runs while the wire works.
	W := l.inst.g.Size()
	zeros := s.Padding == PadZeros
	if zeros && me == W-1 && L > 0 && n > 0 {
		b.addZero = append(b.addZero, l.oneOperand(gxr, L+n-min(L, n), L+n))
	}
	if zeros && me == 0 && R > 0 && n > 0 {
		b.addZero = append(b.addZero, l.oneOperand(gxr, L, L+min(R, n)))
	}
	for _, m := range out {
		op, err := l.recvOp(b, gxr, m.lo-off+L, m.hi-off+L, m.dst, btag, true)
		if err != nil {
			return err
		}
		bops.add(op)
	}
	for _, m := range in {
		op, err := l.sendOp(b, bside[m.side], m.lo-off+L, m.hi-off+L, m.src, btag)
		if err != nil {
			return err
		}
		bops.add(op)
	}
	if !s.HalosOnly {
		b.copyIn = append(b.copyIn, l.twoOperands(gxr, bmid, L, L+n, len(b.aliases)))
		b.aliases = append(b.aliases, innerAlias{gxr.base, bmid.base, l.aliasOffset(s.GradXStrides, s.GradOutStrides)})
	}
	if zeros {
		return nil
	}
	return l.buildPadding(fside, bside, xr, gxr, fops, bops)
}

// tags are the instance's message tags, forward and backward.
func (l layoutBuilder) tags() (fwd, bwd uint64) {
	g, id := l.inst.g, l.inst.ident
	return g.tag(id, phaseForward), g.tag(id, phaseBackward)
}

// aliasOffset is the byte offset at which the unpadded tensor is the padded
// one's interior, if their strides allow it, else -1.
func (l layoutBuilder) aliasOffset(inner, outer []int64) int64 {
	if !slices.Equal(inner, outer) {
		return -1
	}
	return l.spec.Left * outer[l.spec.Dim] * int64(l.elem)
}

// box returns the shape of the padded slices [lo, hi) within region r and
// the element offset of the first of them.
func (l layoutBuilder) box(r region, lo, hi int64) ([]int64, int64) {
	b := slices.Clone(r.shape)
	b[l.spec.Dim] = hi - lo
	return b, (lo - r.first) * r.strides[l.spec.Dim]
}

// oneOperand is a walk over the padded slices [lo, hi) of region r.
func (l layoutBuilder) oneOperand(r region, lo, hi int64) local {
	bx, o := l.box(r, lo, hi)
	return local{w: newWalk(bx, [][]int64{r.strides}, []int64{o}), dst: r.base, src: -1, elem: l.elem, dt: l.spec.DType}
}

// twoOperands is a walk over the padded slices [lo, hi) of both regions.
func (l layoutBuilder) twoOperands(dst, src region, lo, hi int64, layout int) local {
	bx, do := l.box(dst, lo, hi)
	_, so := l.box(src, lo, hi)
	return local{w: newWalk(bx, [][]int64{dst.strides, src.strides}, []int64{do, so}), dst: dst.base, src: src.base,
		elem: l.elem, dt: l.spec.DType, layout: layout}
}

// inPlace says whether a slab goes on the wire straight from or into the
// caller's memory rather than through a staging buffer: the executor's
// choice, since staging is its work; accumulate: what arrives is added.
func (l layoutBuilder) inPlace(w *walk, accumulate bool) (bool, error) {
	in, err := l.inst.exec.inPlace(w, l.elem, accumulate)
	if err != nil {
		return in, fmt.Errorf("%w: rank %d: plan %d: %v: make the tensors' strides keep dim %d's slices in fewer pieces (e.g. dim outermost)",
			ErrInvalid, l.inst.g.Rank(), l.inst.id, err, l.spec.Dim)
	}
	return in, nil
}

// stage adds a staging buffer of bytes to s and returns its base.
func (l layoutBuilder) stage(s *schedule, bytes int64) (int, error) {
	buf, err := l.inst.g.t.Alloc(int(bytes))
	if err != nil {
		return 0, fmt.Errorf("rank %d: staging buffer of %d bytes for plan %d: %w", l.inst.g.Rank(), bytes, l.inst.id, err)
	}
	s.staging = append(s.staging, buf)
	return s.fixed + len(s.staging) - 1, nil
}

// sendOp prepares the send of the padded slices [lo, hi) of region r.
func (l layoutBuilder) sendOp(s *schedule, r region, lo, hi int64, peer int, tag uint64) (*transport.Op, error) {
	bx, o := l.box(r, lo, hi)
	w := wireWalk(bx, [][]int64{r.strides}, []int64{o})
	if w.runs() == 0 {
		return nil, nil // empty tensor: both sides skip the message
	}
	inPlace, err := l.inPlace(&w, false)
	if err != nil {
		return nil, err
	}
	if inPlace {
		return &transport.Op{Peer: peer, Tag: tag, Send: true, Segs: w.segments(l.elem, r.base), Memory: l.spec.Memory}, nil
	}
	bytes := w.runs() * w.run * int64(l.elem)
	base, err := l.stage(s, bytes)
	if err != nil {
		return nil, err
	}
	s.pack = append(s.pack, local{w: newWalk(bx, [][]int64{ContiguousStrides(bx), r.strides}, []int64{0, o}), dst: base, src: r.base,
		elem: l.elem, dt: l.spec.DType})
	return &transport.Op{Peer: peer, Tag: tag, Send: true, Segs: []transport.Segment{{Base: base, Len: bytes}}}, nil
}

// recvOp prepares the receive of the padded slices [lo, hi) of region r: in
// place, or into staging and then unpacked, or (accumulate) into staging and
// then added.
func (l layoutBuilder) recvOp(s *schedule, r region, lo, hi int64, peer int, tag uint64, accumulate bool) (*transport.Op, error) {
	bx, o := l.box(r, lo, hi)
	w := wireWalk(bx, [][]int64{r.strides}, []int64{o})
	if w.runs() == 0 {
		return nil, nil
	}
	inPlace, err := l.inPlace(&w, accumulate)
	if err != nil {
		return nil, err
	}
	if inPlace {
		return &transport.Op{Peer: peer, Tag: tag, Segs: w.segments(l.elem, r.base), Memory: l.spec.Memory}, nil
	}
	bytes := w.runs() * w.run * int64(l.elem)
	base, err := l.stage(s, bytes)
	if err != nil {
		return nil, err
	}
	w = newWalk(bx, [][]int64{r.strides, ContiguousStrides(bx)}, []int64{o, 0})
	work := local{w: w, dst: r.base, src: base, elem: l.elem, dt: l.spec.DType}
	if accumulate {
		s.add = append(s.add, work)
	} else {
		s.unpack = append(s.unpack, work)
	}
	return &transport.Op{Peer: peer, Tag: tag, Segs: []transport.Segment{{Base: base, Len: bytes}}}, nil
}
