package halo

import (
	"fmt"
	"slices"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

// schedule is one direction's prepared work, plain data: the messages (one
// batch) and the local operations around them. Its bases are the caller's
// tensors first (fixed of them: 2 for a padded plan, 3 for a halos-only
// one), then one per staging buffer.
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
	batch   transport.Batch
	bases   []uintptr        // what the batch is posted with
	ptrs    []unsafe.Pointer // the same, for the local work
	staging []transport.Buffer
	pack    []local // before Post: staging <- source
	zero    []local // destination slices outside the sequence (forward)
	addZero []local // destination slices the reference adds zeros to (backward, edge ranks)
	copyIn  []local // the interior, unless the caller aliased it
	unpack  []local // after the wait: destination <- staging
	add     []local // after the wait, in order: destination += staging

	// A padded plan's unpadded tensor may be the padded one's interior:
	// then it is not copied. inner and outer are their bases (-1 for a
	// halos-only plan), alias the byte offset of inner in outer when the
	// strides allow it (-1: never).
	inner, outer int
	alias        int64

	inFlight bool // between start and the wait or test that completes it
}

// local is one walk of local work over bases of the schedule: dst is
// operand 0 of the walk, src (or -1) operand 1.
type local struct {
	w        walk
	dst, src int
}

// region is where a range of slices of the padded tensor [left | x | right]
// lives: in which base, with which shape and strides, from which slice.
type region struct {
	base    int
	shape   []int64
	strides []int64
	first   int64 // the padded slice that is slice 0 of this tensor
}

// build prepares both directions from the agreed partition.
func (p *Plan) build() error {
	s, me := &p.spec, p.g.Rank()
	L, R, n := s.Left, s.Right, s.Shape[s.Dim]
	off := p.part.off[me]
	in := p.part.incoming(me, L, R)
	out := p.part.outgoing(me, L, R)
	padL, padR := p.part.padding(me, L, R)
	ftag, btag := tag(p.id, phaseForward), tag(p.id, phaseBackward)

	f, b := &p.fwd, &p.bwd
	f.what, b.what = "forward", "backward"
	// Where the halo sides and the interior live, per direction.
	var fside, bside [2]region
	var fmid, bmid region
	if s.HalosOnly {
		left, right := s.haloShape(L), s.haloShape(R)
		f.names = []string{"x", "left", "right"}
		b.names = []string{"grad_left", "grad_x", "grad_right"}
		fside = [2]region{{1, left, s.LeftStrides, 0}, {2, right, s.RightStrides, L + n}}
		bside = [2]region{{0, left, s.GradLeftStrides, 0}, {2, right, s.GradRightStrides, L + n}}
		f.inner, f.outer, b.inner, b.outer = -1, -1, -1, -1
	} else {
		o := s.OutShape()
		f.names = []string{"x", "out"}
		b.names = []string{"grad_out", "grad_x"}
		fmid, bmid = region{1, o, s.OutStrides, 0}, region{0, o, s.GradOutStrides, 0}
		fside = [2]region{fmid, fmid}
		bside = [2]region{bmid, bmid}
		f.inner, f.outer, b.inner, b.outer = 0, 1, 1, 0
	}
	xr := region{0, s.Shape, s.XStrides, L}
	gxr := region{1, s.Shape, s.GradXStrides, L}
	f.fixed, b.fixed = len(f.names), len(b.names)
	f.ext = p.extents(f, []region{xr, fside[0], fside[1]})
	b.ext = p.extents(b, []region{bside[0], gxr, bside[1]})

	// Forward: receive the halos, send x's boundary slabs, zero the slices
	// outside the sequence, copy the interior of a padded out.
	var fops []transport.Op
	for _, m := range in {
		op, err := p.recvOp(f, fside[m.side], m.lo-off+L, m.hi-off+L, m.src, ftag, false)
		if err != nil {
			return err
		}
		fops = appendOp(fops, op)
	}
	for _, m := range out {
		op, err := p.sendOp(f, xr, m.lo-off+L, m.hi-off+L, m.dst, ftag)
		if err != nil {
			return err
		}
		fops = appendOp(fops, op)
	}
	for side, r := range [][2]int64{{0, padL}, {L + n + R - padR, L + n + R}} {
		if r[0] < r[1] {
			f.zero = append(f.zero, p.oneOperand(fside[side], r[0], r[1]))
		}
	}
	if !s.HalosOnly {
		f.copyIn = append(f.copyIn, p.twoOperands(fmid, xr, L, L+n))
		f.alias = p.aliasOffset(s.XStrides, s.OutStrides)
	}

	// Backward: gradients of our slices come back from the ranks we sent
	// them to, and are added in the order of `out`. Edge ranks add +0 where
	// the reference adds its zero tensor; x+0 commutes bitwise with the
	// other additions (it only turns -0 into +0 and quiets NaNs), so that
	// pass runs while the wire works.
	var bops []transport.Op
	W := p.g.Size()
	if me == W-1 && L > 0 && n > 0 {
		b.addZero = append(b.addZero, p.oneOperand(gxr, L+n-min(L, n), L+n))
	}
	if me == 0 && R > 0 && n > 0 {
		b.addZero = append(b.addZero, p.oneOperand(gxr, L, L+min(R, n)))
	}
	for _, m := range out {
		op, err := p.recvOp(b, gxr, m.lo-off+L, m.hi-off+L, m.dst, btag, true)
		if err != nil {
			return err
		}
		bops = appendOp(bops, op)
	}
	for _, m := range in {
		op, err := p.sendOp(b, bside[m.side], m.lo-off+L, m.hi-off+L, m.src, btag)
		if err != nil {
			return err
		}
		bops = appendOp(bops, op)
	}
	if !s.HalosOnly {
		b.copyIn = append(b.copyIn, p.twoOperands(gxr, bmid, L, L+n))
		b.alias = p.aliasOffset(s.GradXStrides, s.GradOutStrides)
	}

	for _, sc := range []struct {
		s   *schedule
		ops []transport.Op
	}{{f, fops}, {b, bops}} {
		sc.s.bases = make([]uintptr, sc.s.fixed+len(sc.s.staging))
		sc.s.ptrs = make([]unsafe.Pointer, len(sc.s.bases))
		for i, buf := range sc.s.staging {
			sc.s.bases[sc.s.fixed+i] = buf.Addr()
			sc.s.ptrs[sc.s.fixed+i] = unsafe.Pointer(unsafe.SliceData(buf.Bytes()))
		}
		if len(sc.ops) > 0 {
			batch, err := p.g.t.Prepare(sc.ops)
			if err != nil {
				return fmt.Errorf("rank %d: preparing plan %d: %w", me, p.id, err)
			}
			sc.s.batch = batch
		}
	}
	return nil
}

// haloShape is the shape of a halo tensor of k slices.
func (s *Spec) haloShape(k int64) []int64 {
	h := slices.Clone(s.Shape)
	h[s.Dim] = k
	return h
}

// extents are the byte extents of the fixed bases, from their regions.
func (p *Plan) extents(s *schedule, rs []region) []int64 {
	ext := make([]int64, s.fixed)
	for _, r := range rs[:s.fixed] {
		ext[r.base], _ = extent(r.shape, r.strides, p.elem)
	}
	return ext
}

// aliasOffset is the byte offset at which the unpadded tensor is the padded
// one's interior, if their strides allow it, else -1.
func (p *Plan) aliasOffset(inner, outer []int64) int64 {
	if !slices.Equal(inner, outer) {
		return -1
	}
	return p.spec.Left * outer[p.spec.Dim] * int64(p.elem)
}

func appendOp(ops []transport.Op, op *transport.Op) []transport.Op {
	if op == nil {
		return ops
	}
	return append(ops, *op)
}

// box returns the shape of the padded slices [lo, hi) within region r and
// the element offset of the first of them.
func (p *Plan) box(r region, lo, hi int64) ([]int64, int64) {
	b := slices.Clone(r.shape)
	b[p.spec.Dim] = hi - lo
	return b, (lo - r.first) * r.strides[p.spec.Dim]
}

// oneOperand is a walk over the padded slices [lo, hi) of region r.
func (p *Plan) oneOperand(r region, lo, hi int64) local {
	bx, o := p.box(r, lo, hi)
	return local{w: newWalk(bx, [][]int64{r.strides}, []int64{o}), dst: r.base, src: -1}
}

// twoOperands is a walk over the padded slices [lo, hi) of both regions.
func (p *Plan) twoOperands(dst, src region, lo, hi int64) local {
	bx, do := p.box(dst, lo, hi)
	_, so := p.box(src, lo, hi)
	return local{w: newWalk(bx, [][]int64{dst.strides, src.strides}, []int64{do, so}), dst: dst.base, src: src.base}
}

// inPlace decides whether a slab goes on the wire from/to the caller's
// memory (contiguous or IOV) rather than through a staging buffer.
func (p *Plan) inPlace(w *walk) bool {
	runs := w.runs()
	if runs <= 1 {
		return true
	}
	o := &p.g.opts
	switch o.Transfer {
	case TransferPack:
		return false
	case TransferIOV:
		return runs <= 1<<16
	}
	return runs <= int64(o.IOVMaxSegments) && w.run*int64(p.elem) >= o.IOVMinSegment
}

// stage adds a staging buffer of bytes to s and returns its base.
func (p *Plan) stage(s *schedule, bytes int64) (int, error) {
	buf, err := p.g.t.Alloc(int(bytes))
	if err != nil {
		return 0, fmt.Errorf("rank %d: staging buffer of %d bytes for plan %d: %w", p.g.Rank(), bytes, p.id, err)
	}
	s.staging = append(s.staging, buf)
	return s.fixed + len(s.staging) - 1, nil
}

// sendOp prepares the send of the padded slices [lo, hi) of region r.
func (p *Plan) sendOp(s *schedule, r region, lo, hi int64, peer int, tag uint64) (*transport.Op, error) {
	bx, o := p.box(r, lo, hi)
	w := newWalk(bx, [][]int64{r.strides}, []int64{o})
	if w.runs() == 0 {
		return nil, nil // empty tensor: both sides skip the message
	}
	if p.inPlace(&w) {
		return &transport.Op{Peer: peer, Tag: tag, Send: true, Segs: w.segments(p.elem, r.base)}, nil
	}
	bytes := w.runs() * w.run * int64(p.elem)
	base, err := p.stage(s, bytes)
	if err != nil {
		return nil, err
	}
	s.pack = append(s.pack, local{w: newWalk(bx, [][]int64{ContiguousStrides(bx), r.strides}, []int64{0, o}), dst: base, src: r.base})
	return &transport.Op{Peer: peer, Tag: tag, Send: true, Segs: []transport.Segment{{Base: base, Len: bytes}}}, nil
}

// recvOp prepares the receive of the padded slices [lo, hi) of region r: in
// place, or into staging and then unpacked, or (accumulate) into staging and
// then added.
func (p *Plan) recvOp(s *schedule, r region, lo, hi int64, peer int, tag uint64, accumulate bool) (*transport.Op, error) {
	bx, o := p.box(r, lo, hi)
	w := newWalk(bx, [][]int64{r.strides}, []int64{o})
	if w.runs() == 0 {
		return nil, nil
	}
	if !accumulate && p.inPlace(&w) {
		return &transport.Op{Peer: peer, Tag: tag, Segs: w.segments(p.elem, r.base)}, nil
	}
	bytes := w.runs() * w.run * int64(p.elem)
	base, err := p.stage(s, bytes)
	if err != nil {
		return nil, err
	}
	l := local{w: newWalk(bx, [][]int64{r.strides, ContiguousStrides(bx)}, []int64{o, 0}), dst: r.base, src: base}
	if accumulate {
		s.add = append(s.add, l)
	} else {
		s.unpack = append(s.unpack, l)
	}
	return &transport.Op{Peer: peer, Tag: tag, Segs: []transport.Segment{{Base: base, Len: bytes}}}, nil
}
