package halo

import (
	"fmt"
	"slices"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo/transport"
)

// build prepares both directions from the agreed partition.
func (p *Plan) build() error {
	s, me, d := &p.spec, p.g.Rank(), p.spec.Dim
	L, R, n := s.Left, s.Right, s.Shape[d]
	off := p.part.off[me]
	in := p.part.incoming(me, L, R)
	out := p.part.outgoing(me, L, R)
	outShape := s.OutShape()
	elem := int64(p.elem)

	// Forward: source x (base 0) -> destination out (base 1).
	f := &p.fwd
	f.what, f.srcName, f.dstName = "forward", "x", "out"
	f.srcExt, _ = extent(s.Shape, s.XStrides, p.elem)
	f.dstExt, _ = extent(outShape, s.OutStrides, p.elem)
	var fops []transport.Op
	for _, m := range in {
		op, err := p.recvOp(f, outShape, s.OutStrides, m.lo-off+L, m.hi-off+L, m.src, tag(p.id, phaseForward), false)
		if err != nil {
			return err
		}
		if op != nil {
			fops = append(fops, *op)
		}
	}
	for _, m := range out {
		op, err := p.sendOp(f, s.Shape, s.XStrides, m.lo-off, m.hi-off, m.dst, tag(p.id, phaseForward))
		if err != nil {
			return err
		}
		if op != nil {
			fops = append(fops, *op)
		}
	}
	padL, padR := p.part.padding(me, L, R)
	for _, r := range [][2]int64{{0, padL}, {L + n + R - padR, L + n + R}} {
		if r[0] < r[1] {
			b, o := p.box(outShape, s.OutStrides, r[0], r[1])
			f.zero = append(f.zero, newWalk(b, [][]int64{s.OutStrides}, []int64{o}))
		}
	}
	f.interior = newWalk(s.Shape, [][]int64{s.OutStrides, s.XStrides}, []int64{L * s.OutStrides[d], 0})
	f.alias = -1
	if slices.Equal(s.XStrides, s.OutStrides) {
		f.alias = L * s.OutStrides[d] * elem
	}

	// Backward: source grad_out (base 0) -> destination grad_x (base 1).
	// Gradients of our slices come back from the ranks we sent them to, and
	// are added in the order of `out`. Edge ranks add +0 where the reference
	// adds its zero tensor; x+0 commutes bitwise with the other additions (it
	// only turns -0 into +0 and quiets NaNs), so that pass runs while the
	// wire works.
	b := &p.bwd
	b.what, b.srcName, b.dstName, b.srcPadded = "backward", "grad_out", "grad_x", true
	b.srcExt, _ = extent(outShape, s.GradOutStrides, p.elem)
	b.dstExt, _ = extent(s.Shape, s.GradXStrides, p.elem)
	var bops []transport.Op
	W := p.g.Size()
	if me == W-1 && L > 0 && n > 0 {
		bx, o := p.box(s.Shape, s.GradXStrides, n-min(L, n), n)
		b.addZero = append(b.addZero, newWalk(bx, [][]int64{s.GradXStrides}, []int64{o}))
	}
	if me == 0 && R > 0 && n > 0 {
		bx, o := p.box(s.Shape, s.GradXStrides, 0, min(R, n))
		b.addZero = append(b.addZero, newWalk(bx, [][]int64{s.GradXStrides}, []int64{o}))
	}
	for _, m := range out {
		op, err := p.recvOp(b, s.Shape, s.GradXStrides, m.lo-off, m.hi-off, m.dst, tag(p.id, phaseBackward), true)
		if err != nil {
			return err
		}
		if op != nil {
			bops = append(bops, *op)
		}
	}
	for _, m := range in {
		op, err := p.sendOp(b, outShape, s.GradOutStrides, m.lo-off+L, m.hi-off+L, m.src, tag(p.id, phaseBackward))
		if err != nil {
			return err
		}
		if op != nil {
			bops = append(bops, *op)
		}
	}
	b.interior = newWalk(s.Shape, [][]int64{s.GradXStrides, s.GradOutStrides}, []int64{0, L * s.GradOutStrides[d]})
	b.alias = -1
	if slices.Equal(s.GradXStrides, s.GradOutStrides) {
		b.alias = L * s.GradOutStrides[d] * elem
	}

	for _, sc := range []struct {
		s   *schedule
		ops []transport.Op
	}{{f, fops}, {b, bops}} {
		sc.s.bases = make([]uintptr, 2+len(sc.s.staging))
		for i, buf := range sc.s.staging {
			sc.s.bases[2+i] = buf.Addr()
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

func (p *Plan) stage(s *schedule, bytes int64) (int, error) {
	buf, err := p.g.t.Alloc(int(bytes))
	if err != nil {
		return 0, fmt.Errorf("rank %d: staging buffer of %d bytes for plan %d: %w", p.g.Rank(), bytes, p.id, err)
	}
	s.staging = append(s.staging, buf)
	return len(s.staging) - 1, nil
}

// sendOp prepares the send of slices [lo, hi) of the source tensor (base 0).
func (p *Plan) sendOp(s *schedule, shape, strides []int64, lo, hi int64, peer int, tag uint64) (*transport.Op, error) {
	bx, o := p.box(shape, strides, lo, hi)
	w := newWalk(bx, [][]int64{strides}, []int64{o})
	if w.runs() == 0 {
		return nil, nil // empty tensor: both sides skip the message
	}
	if p.inPlace(&w) {
		return &transport.Op{Peer: peer, Tag: tag, Send: true, Base: 0, Segs: w.segments(p.elem)}, nil
	}
	bytes := w.runs() * w.run * int64(p.elem)
	i, err := p.stage(s, bytes)
	if err != nil {
		return nil, err
	}
	s.pack = append(s.pack, staged{w: newWalk(bx, [][]int64{ContiguousStrides(bx), strides}, []int64{0, o}), buf: i})
	return &transport.Op{Peer: peer, Tag: tag, Send: true, Base: 2 + i, Segs: []transport.Segment{{Off: 0, Len: bytes}}}, nil
}

// recvOp prepares the receive of slices [lo, hi) of the destination tensor
// (base 1): in place, or into staging and then unpacked, or (accumulate)
// into staging and then added.
func (p *Plan) recvOp(s *schedule, shape, strides []int64, lo, hi int64, peer int, tag uint64, accumulate bool) (*transport.Op, error) {
	bx, o := p.box(shape, strides, lo, hi)
	w := newWalk(bx, [][]int64{strides}, []int64{o})
	if w.runs() == 0 {
		return nil, nil
	}
	if !accumulate && p.inPlace(&w) {
		return &transport.Op{Peer: peer, Tag: tag, Base: 1, Segs: w.segments(p.elem)}, nil
	}
	bytes := w.runs() * w.run * int64(p.elem)
	i, err := p.stage(s, bytes)
	if err != nil {
		return nil, err
	}
	st := staged{w: newWalk(bx, [][]int64{strides, ContiguousStrides(bx)}, []int64{o, 0}), buf: i}
	if accumulate {
		s.add = append(s.add, st)
	} else {
		s.unpack = append(s.unpack, st)
	}
	return &transport.Op{Peer: peer, Tag: tag, Base: 2 + i, Segs: []transport.Segment{{Off: 0, Len: bytes}}}, nil
}

// Forward fills out = [left halo | x | right halo] along dim. x may be the
// interior of out (same strides, at slice Left): then it is not copied.
func (p *Plan) Forward(x, out unsafe.Pointer) error {
	if err := p.start(&p.fwd, x, out); err != nil {
		return err
	}
	return p.finish(&p.fwd)
}

// Backward computes grad_x = interior of grad_out + the gradients of x's
// slices that other ranks used as halo. grad_x may be the interior of
// grad_out (same strides, at slice Left).
func (p *Plan) Backward(gradOut, gradX unsafe.Pointer) error {
	if err := p.start(&p.bwd, gradOut, gradX); err != nil {
		return err
	}
	return p.finish(&p.bwd)
}

// start begins one direction: it checks the pointers, packs the outgoing
// slabs, posts every message, and then does the local work that needs
// nothing from the wire (padding, the interior, the edge ranks' +0) while
// the messages travel. finish completes it. Between the two the caller's
// tensors belong to the exchange.
func (p *Plan) start(s *schedule, src, dst unsafe.Pointer) error {
	me := p.g.Rank()
	if p.closed {
		return fmt.Errorf("rank %d: %s on plan %d: %w", me, s.what, p.id, ErrClosed)
	}
	if s.inFlight {
		return fmt.Errorf("%w: rank %d: %s of plan %d is already in flight", ErrState, me, s.what, p.id)
	}
	if err := p.g.usable(); err != nil {
		return err
	}
	if (src == nil && s.srcExt > 0) || (dst == nil && s.dstExt > 0) {
		name := s.srcName
		if src != nil {
			name = s.dstName
		}
		return fmt.Errorf("%w: rank %d: %s of plan %d: %s is NULL", ErrInvalid, me, s.what, p.id, name)
	}
	aliased, err := p.aliasing(s, src, dst)
	if err != nil {
		return fmt.Errorf("%w: rank %d: %s of plan %d: %v", ErrInvalid, me, s.what, p.id, err)
	}
	x, dt := p.g.exec, p.spec.DType
	for i := range s.pack {
		x.copy(&s.pack[i].w, p.elem, stagingPtr(s, s.pack[i].buf), src)
	}
	if s.batch != nil {
		s.bases[0], s.bases[1] = uintptr(src), uintptr(dst)
		if err := s.batch.Post(s.bases); err != nil {
			return p.g.fail(fmt.Errorf("rank %d: %s of plan %d: %w", me, s.what, p.id, err))
		}
	}
	for i := range s.zero {
		x.zero(&s.zero[i], p.elem, dst)
	}
	if !aliased {
		x.copy(&s.interior, p.elem, dst, src)
	}
	for i := range s.addZero {
		x.addZero(&s.addZero[i], dt, dst)
	}
	s.dst, s.inFlight = dst, true
	return nil
}

// finish waits for the messages of the direction start began, then unpacks
// and adds what arrived, in the order of the output.
func (p *Plan) finish(s *schedule) error {
	me := p.g.Rank()
	if !s.inFlight {
		return fmt.Errorf("%w: rank %d: %s of plan %d was not started", ErrState, me, s.what, p.id)
	}
	dst := s.dst
	s.dst, s.inFlight = nil, false
	if s.batch != nil {
		if err := s.batch.Wait(time.Now().Add(p.g.opts.Timeout)); err != nil {
			return p.g.fail(fmt.Errorf("rank %d: %s of plan %d: %w", me, s.what, p.id, err))
		}
	}
	x, dt := p.g.exec, p.spec.DType
	for i := range s.unpack {
		x.copy(&s.unpack[i].w, p.elem, dst, stagingPtr(s, s.unpack[i].buf))
	}
	for i := range s.add {
		x.add(&s.add[i].w, dt, dst, stagingPtr(s, s.add[i].buf))
	}
	return nil
}

// aliasing tells whether the unpadded tensor is exactly the interior of the
// padded one, and refuses any other overlap (it would be silent garbage).
func (p *Plan) aliasing(s *schedule, src, dst unsafe.Pointer) (bool, error) {
	padded, inner, padExt, innerExt := uintptr(dst), uintptr(src), s.dstExt, s.srcExt
	paddedName, innerName := s.dstName, s.srcName
	if s.srcPadded {
		padded, inner, padExt, innerExt = inner, padded, innerExt, padExt
		paddedName, innerName = innerName, paddedName
	}
	if padExt == 0 || innerExt == 0 {
		return false, nil
	}
	if s.alias >= 0 && inner == padded+uintptr(s.alias) {
		return true, nil
	}
	if inner < padded+uintptr(padExt) && padded < inner+uintptr(innerExt) {
		return false, fmt.Errorf("%s overlaps %s but is not its interior (it must be %s narrowed to slices [%d, %d) along dim %d with the same strides, or not overlap it)",
			innerName, paddedName, paddedName, p.spec.Left, p.spec.Left+p.spec.Shape[p.spec.Dim], p.spec.Dim)
	}
	return false, nil
}

func stagingPtr(s *schedule, i int) unsafe.Pointer {
	return unsafe.Pointer(unsafe.SliceData(s.staging[i].Bytes()))
}
