package halo

import (
	"fmt"
	"slices"

	"github.com/halo-cp/halo/halo/transport"
)

// The padding modes other than zeros fill the halo slots outside the global
// sequence [0, T) from slices of the sequence, which may live on any rank
// (circular: rank 0's left halo ends the sequence; with halos longer than
// shards even rank 0's reflected slices may be rank 1's). Each slot is a
// small forward copy from its source slice, and in the backward its gradient
// is added to that slice in the order of torch's F.pad backward (below).

// Source is the global slice that padded global position g shows in a
// sequence of T slices (g itself inside it), and false where zeros padding
// shows a zero.
func (m Padding) Source(g, T int64) (int64, bool) {
	if g >= 0 && g < T {
		return g, true
	}
	if m == PadZeros {
		return 0, false
	}
	return m.source(g, T), true
}

// source is the global slice that fills the slot at global position g, for
// a sequence of T slices (g < 0 or g >= T).
func (m Padding) source(g, T int64) int64 {
	switch m {
	case PadReplicate:
		return min(max(g, 0), T-1)
	case PadReflect:
		if g < 0 {
			return -g
		}
		return 2*(T-1) - g
	case PadCircular:
		return (g%T + T) % T
	}
	panic(fmt.Sprintf("halo: no source slices under %v padding", m))
}

// step is how the source moves as the slot moves one to the right.
func (m Padding) step() int64 {
	switch m {
	case PadReplicate:
		return 0
	case PadReflect:
		return -1
	}
	return 1
}

// checkPadding refuses halos that the global sequence cannot serve, by
// torch's rules (F.pad, torch 1.13): reflect needs each halo shorter than
// the sequence, circular no longer than it, replicate a non-empty sequence.
// Every rank knows the global length once the plan is agreed, so every rank
// reports the same error.
func (p partition) checkPadding(s *Spec) error {
	T, L, R := p.total, s.Left, s.Right
	var bad bool
	var need string
	switch s.Padding {
	case PadReplicate:
		bad, need = T == 0 && L+R > 0, "a non-empty sequence"
	case PadReflect:
		bad, need = (L > 0 && L >= T) || (R > 0 && R >= T), "halos shorter than the sequence"
	case PadCircular:
		bad, need = L > T || R > T, "halos no longer than the sequence"
	}
	if !bad {
		return nil
	}
	return fmt.Errorf("%v padding needs %s: left halo %d, right halo %d, global length %d along dim %d",
		s.Padding, need, L, R, T, s.Dim)
}

// owner is the rank that holds global slice g.
func (p partition) owner(g int64) int {
	for q := range p.n {
		if g >= p.off[q] && g < p.off[q]+p.n[q] {
			return q
		}
	}
	panic(fmt.Sprintf("halo: no rank holds slice %d of %d", g, p.total))
}

// padPiece is a run of slots, global positions [g, g+k) of rank dst's halo,
// filled with the global slices src, src+step, …, which rank owner holds.
// The wire carries the distinct sources in increasing order (sources); a
// reflected (step -1) or replicated (step 0) run is laid out by the receiver.
type padPiece struct {
	owner, dst int
	g, k       int64
	src, step  int64
}

func (pc padPiece) sources() (lo, hi int64) {
	switch {
	case pc.step > 0:
		return pc.src, pc.src + pc.k
	case pc.step < 0:
		return pc.src - pc.k + 1, pc.src + 1
	}
	return pc.src, pc.src + 1
}

// padPieces lists every rank's padding slots as runs, in one order that
// every rank computes alike: by receiving rank, left side then right, by
// position. A rank sends and receives its pieces in this order, after the
// messages of the sequence's own halos, so that pieces between the same two
// ranks (circular on two ranks: left and right halo from one peer) travel
// in one message that both ends lay out alike.
func (p partition) padPieces(L, R int64, m Padding) []padPiece {
	if m == PadZeros {
		return nil
	}
	var ps []padPiece
	for d := range p.n {
		end := p.off[d] + p.n[d]
		for _, w := range [2][2]int64{{p.off[d] - L, min(p.off[d], 0)}, {max(end, p.total), end + R}} {
			for g := w[0]; g < w[1]; g++ {
				s := m.source(g, p.total)
				q := p.owner(s)
				if k := len(ps) - 1; k >= 0 {
					last := &ps[k]
					if last.dst == d && last.owner == q && last.g+last.k == g && last.src+last.step*last.k == s {
						last.k++
						continue
					}
				}
				ps = append(ps, padPiece{owner: q, dst: d, g: g, k: 1, src: s, step: m.step()})
			}
		}
	}
	for i := range ps {
		if ps[i].k == 1 {
			ps[i].step = 1 // one slot: received in place, whatever the mode
		}
	}
	return ps
}

// slot is one slice of a tensor or buffer: base, strides, element offset.
type slot struct {
	base    int
	strides []int64
	off     int64
}

// at is the slot of padded slice pos of region r.
func (l layoutBuilder) at(r region, pos int64) slot {
	return slot{r.base, r.strides, (pos - r.first) * r.strides[l.spec.Dim]}
}

// stepped copies k slices into region dst from padded slice dpos on,
// reading region src from slice spos on, step slices apart (0: the same
// slice, -1: backwards).
func (l layoutBuilder) stepped(dst region, dpos, k int64, src region, spos, step int64) local {
	bx, do := l.box(dst, dpos, dpos+k)
	_, so := l.box(src, spos, spos+1)
	ss := slices.Clone(src.strides)
	ss[l.spec.Dim] *= step
	return local{w: newWalk(bx, [][]int64{dst.strides, ss}, []int64{do, so}), dst: dst.base, src: src.base,
		elem: l.elem, dt: l.spec.DType}
}

// sliceOp copies (or with add, adds) one slice.
func (l layoutBuilder) sliceOp(dst, src slot, add bool) local {
	sh := l.spec.haloShape(1)
	return local{w: newWalk(sh, [][]int64{dst.strides, src.strides}, []int64{dst.off, src.off}), dst: dst.base, src: src.base,
		elem: l.elem, dt: l.spec.DType, add: add}
}

// stagedRegion allocates a staging buffer for k slices, a region whose
// slice first is its first.
func (l layoutBuilder) stagedRegion(s *schedule, k, first int64) (region, error) {
	bx := l.spec.haloShape(k)
	base, err := l.stage(s, sliceElems(bx, l.spec.Dim)*k*int64(l.elem))
	return region{base, bx, ContiguousStrides(bx), first}, err
}

// recv receives the whole of staged region r.
func (r region) recv(peer int, tag uint64, elem int) *transport.Op {
	n := int64(elem)
	for _, x := range r.shape {
		n *= x
	}
	return &transport.Op{Peer: peer, Tag: tag, Segs: []transport.Segment{{Base: r.base, Len: n}}}
}

// sliceElems is the number of elements of one slice along dim.
func sliceElems(shape []int64, dim int) int64 {
	n := int64(1)
	for i, x := range shape {
		if i != dim {
			n *= x
		}
	}
	return n
}

// zeroSpans are the global slices to which torch's F.pad backward adds +0
// (which turns -0 into +0; nothing else): replicate and reflect start from
// a zero tensor, so every slice. Circular adds +0 to every slice when the
// halos together are longer than the sequence (L + R > T); otherwise to
// every slice that is not a source of a right slot ([0, R)) when R > 0,
// and to every slice that is not a source of a left slot ([T-L, T)) when
// L > 0. torch 1.13 and 2.15 agree: halo/testdata/circular_zeros.json is
// their table, which the oracle reads.
func zeroSpans(m Padding, L, R, T int64) [][2]int64 {
	if m != PadCircular || L+R > T {
		return [][2]int64{{0, T}}
	}
	switch {
	case L > 0 && R > 0: // all but the sources of both sides
		return [][2]int64{{0, max(T-L, 0)}, {max(R, T-L), T}}
	case L > 0:
		return [][2]int64{{0, T - L}}
	case R > 0:
		return [][2]int64{{R, T}}
	}
	return nil
}

// contribution is one rank's gradient of a padding slot.
type contribution struct {
	rank int
	at   slot
}

// buildPadding adds the padding slots' work of layout l to both schedules:
// in the forward, the copies and messages that fill this rank's slots and
// those it is the source of; in the backward, the reverse messages and the
// additions into grad_x, in torch's order.
func (l layoutBuilder) buildPadding(fside, bside [2]region, xr, gxr region, fops, bops *opList) error {
	s, me := l.spec, l.inst.g.Rank()
	L, n, off := s.Left, s.Shape[s.Dim], l.part.off[me]
	if sliceElems(s.Shape, s.Dim) == 0 {
		return nil // slices of no elements: nothing to move or add
	}
	f, b := &l.inst.fwd, &l.inst.bwd
	ftag, btag := l.tags()
	pos := func(g int64) int64 { return g - off + L } // this rank's padded slice of global slice g
	side := func(g int64) int {
		if g < off {
			return sideLeft
		}
		return sideRight
	}
	// Where torch's backward adds +0 (zeroSpans), so do we; +0 commutes
	// bitwise with the other additions, so it runs while the wire works.
	for _, z := range zeroSpans(s.Padding, L, s.Right, l.part.total) {
		if lo, hi := max(z[0], off), min(z[1], off+n); lo < hi {
			b.addZero = append(b.addZero, l.oneOperand(gxr, pos(lo), pos(hi)))
		}
	}
	contrib := map[int64][]contribution{}
	for _, pc := range l.part.padPieces(L, s.Right, s.Padding) {
		lo, hi := pc.sources()
		switch {
		case pc.dst == me && pc.owner == me:
			f.fill = append(f.fill, l.stepped(fside[side(pc.g)], pos(pc.g), pc.k, xr, pos(pc.src), pc.step))
			for g := pc.g; g < pc.g+pc.k; g++ {
				contrib[g] = append(contrib[g], contribution{me, l.at(bside[side(g)], pos(g))})
			}
		case pc.dst == me:
			var op *transport.Op
			var err error
			if pc.step == 1 {
				op, err = l.recvOp(f, fside[side(pc.g)], pos(pc.g), pos(pc.g)+pc.k, pc.owner, ftag, false)
			} else {
				var st region
				if st, err = l.stagedRegion(f, hi-lo, lo); err == nil {
					f.unpack = append(f.unpack, l.stepped(fside[side(pc.g)], pos(pc.g), pc.k, st, pc.src, pc.step))
					op = st.recv(pc.owner, ftag, l.elem)
				}
			}
			if err != nil {
				return err
			}
			fops.add(op)
			op, err = l.sendOp(b, bside[side(pc.g)], pos(pc.g), pos(pc.g)+pc.k, pc.owner, btag)
			if err != nil {
				return err
			}
			bops.add(op)
		case pc.owner == me: // our slices fill another rank's slots
			op, err := l.sendOp(f, xr, pos(lo), pos(hi), pc.dst, ftag)
			if err != nil {
				return err
			}
			fops.add(op)
			st, err := l.stagedRegion(b, pc.k, pc.g)
			if err != nil {
				return err
			}
			bops.add(st.recv(pc.dst, btag, l.elem))
			for g := pc.g; g < pc.g+pc.k; g++ {
				contrib[g] = append(contrib[g], contribution{pc.dst, l.at(st, g)})
			}
		}
	}
	return l.combinePadding(contrib, gxr)
}

// combinePadding adds the padding slots' gradients into this rank's slices
// of grad_x, once the interior (the slice's own gradient and the halo
// gradients of the sequence) is complete. The order is torch's F.pad
// backward (torch 1.13, CPU), applied to the gathered padded gradient:
//
//   - a slot's gradient, when several ranks' halos hold it (halos longer
//     than shards), is their sum, the ranks nearest the sequence's end first;
//   - replicate adds every slot mapping to a slice in increasing position,
//     from +0: for slice 0 the left slots' sum, then the slice's own
//     gradient, then (when T = 1) each right slot;
//   - reflect: the left slot, the slice's own gradient, the right slot;
//   - circular: the slice's own gradient, the right slot, the left slot.
func (l layoutBuilder) combinePadding(contrib map[int64][]contribution, gxr region) error {
	s, me := l.spec, l.inst.g.Rank()
	L, R, T := s.Left, s.Right, l.part.total
	off, n := l.part.off[me], s.Shape[s.Dim]
	b := &l.inst.bwd
	var scratch [2]*slot
	tmp := func(i int) (slot, error) {
		if scratch[i] == nil {
			r, err := l.stagedRegion(b, 1, 0)
			if err != nil {
				return slot{}, err
			}
			scratch[i] = &slot{r.base, r.strides, 0}
		}
		return *scratch[i], nil
	}
	// sum leaves slot g's gradient in one slot: its only contribution, or
	// their sum in scratch buffer i (then summed is true).
	sum := func(g int64, i int) (at slot, summed bool, err error) {
		cs := contrib[g]
		if len(cs) == 1 {
			return cs[0].at, false, nil
		}
		slices.SortFunc(cs, func(a, c contribution) int {
			if g < 0 {
				return a.rank - c.rank
			}
			return c.rank - a.rank
		})
		t, err := tmp(i)
		if err != nil {
			return slot{}, false, err
		}
		b.combine = append(b.combine, l.sliceOp(t, cs[0].at, false))
		for _, c := range cs[1:] {
			b.combine = append(b.combine, l.sliceOp(t, c.at, true))
		}
		return t, true, nil
	}
	// add adds the slots' gradients, summed left to right first, to dst.
	add := func(dst slot, gs ...int64) error {
		if len(gs) == 0 {
			return nil
		}
		acc, summed, err := sum(gs[0], 0)
		if err != nil {
			return err
		}
		if len(gs) > 1 {
			t, err := tmp(0)
			if err != nil {
				return err
			}
			if !summed {
				b.combine = append(b.combine, l.sliceOp(t, acc, false))
			}
			for _, g := range gs[1:] {
				v, _, err := sum(g, 1)
				if err != nil {
					return err
				}
				b.combine = append(b.combine, l.sliceOp(t, v, true))
			}
			acc = t
		}
		b.combine = append(b.combine, l.sliceOp(dst, acc, true))
		return nil
	}
	span := func(lo, hi int64) []int64 {
		var gs []int64
		for g := lo; g < hi; g++ {
			gs = append(gs, g)
		}
		return gs
	}
	for g := off; g < off+n; g++ {
		dst := l.at(gxr, g-off+L)
		var err error
		switch s.Padding {
		case PadReplicate:
			if g == 0 {
				err = add(dst, span(-L, 0)...)
			}
			if g == T-1 {
				for _, r := range span(T, T+R) {
					if err == nil {
						err = add(dst, r)
					}
				}
			}
		case PadReflect:
			if g >= 1 && g <= L {
				err = add(dst, -g)
			}
			if r := 2*(T-1) - g; err == nil && r >= T && r < T+R {
				err = add(dst, r)
			}
		case PadCircular:
			if g < R {
				err = add(dst, g+T)
			}
			if err == nil && g >= T-L {
				err = add(dst, g-T)
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}
