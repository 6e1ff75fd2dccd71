package halo

import (
	"fmt"
	"math"
	"math/bits"

	"github.com/halo-cp/halo/halo/transport"
)

// MaxDims is the largest tensor rank a plan accepts.
const MaxDims = 8

// ContiguousStrides returns row-major strides, in elements, for shape.
func ContiguousStrides(shape []int64) []int64 {
	s := make([]int64, len(shape))
	acc := int64(1)
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = acc
		acc *= shape[i]
	}
	return s
}

// extent returns one past the largest element offset a layout can touch,
// or an error when that does not fit in int64 bytes.
func extent(shape, strides []int64, elem int) (int64, error) {
	last := uint64(0)
	for i, n := range shape {
		if n == 0 {
			return 0, nil
		}
		hi, lo := bits.Mul64(uint64(n-1), uint64(strides[i]))
		if hi != 0 {
			return 0, errOverflow
		}
		var c uint64
		last, c = bits.Add64(last, lo, 0)
		if c != 0 {
			return 0, errOverflow
		}
	}
	hi, lo := bits.Mul64(last+1, uint64(elem))
	if last == math.MaxUint64 || hi != 0 || lo > math.MaxInt64 {
		return 0, errOverflow
	}
	return int64(lo), nil
}

var errOverflow = fmt.Errorf("the tensor's byte extent overflows 64 bits")

// checkStrides validates a layout. A tensor that is written to must not
// overlap itself; a sufficient check is that, in increasing stride order,
// each stride clears the previous dimension's whole span.
func checkStrides(shape, strides []int64, elem int, writable bool) error {
	for i, s := range strides {
		if s < 0 {
			return fmt.Errorf("stride[%d] = %d is negative", i, s)
		}
	}
	if _, err := extent(shape, strides, elem); err != nil {
		return err
	}
	if !writable {
		return nil
	}
	order := make([]int, 0, len(shape))
	for i, n := range shape {
		if n == 0 {
			return nil // empty tensor: nothing is written
		}
		if n > 1 {
			order = append(order, i)
		}
	}
	for a := 1; a < len(order); a++ { // insertion sort by stride; ndim <= 8
		for b := a; b > 0 && strides[order[b]] < strides[order[b-1]]; b-- {
			order[b], order[b-1] = order[b-1], order[b]
		}
	}
	span := int64(1)
	for _, i := range order {
		if strides[i] < span {
			return fmt.Errorf("strides %v overlap in memory for shape %v (a written tensor must not alias itself)", strides, shape)
		}
		span = strides[i] * shape[i]
	}
	return nil
}

// walk visits a box of a tensor as runs of elements that are contiguous in
// every operand at once. Operands share the box's logical shape and may have
// different strides. A wire walk (wireWalk) visits runs in logical row-major
// order, the order of bytes on the wire, so sender and receiver agree
// whatever their layouts; a local walk (newWalk) visits them in the
// operands' memory order, so that a channels-last copy coalesces into long
// runs instead of going one element at a time.
type walk struct {
	run     int64     // elements per run
	outer   []int64   // coalesced outer shape, outermost first
	strides [][]int64 // per operand, per outer dim, in elements
	base    []int64   // per operand, offset of the first element, in elements
	off     []int64   // scratch for each: a walk is used by one goroutine at a time
	idx     []int64
	step    []int64 // zeros, the row step of a walk without outer dims
}

// newWalk builds the walk of the box shape over operands with the given
// strides and base offsets (in elements), for local work (copies, fills,
// additions): in memory order, dims from the largest stride to the
// smallest, merged where contiguous in every operand. Each element is
// visited once, which is all that local work needs of the order. Where the
// operands' orders differ (a transposing copy), operand 0's (the one
// written) leads: sequential stores and strided loads beat the reverse,
// whose every store must fetch its line first (a channels-last halo
// unpacked from the wire's order: 5.2 against 3.2 GB/s; pack 12.7 against
// 1.7, go test -bench TransposePack ./halo/).
func newWalk(shape []int64, strides [][]int64, base []int64) walk {
	return buildWalk(shape, strides, base, memoryOrder(shape, strides, 0))
}

// memoryOrder lists shape's dims of size other than 1 from the largest
// stride to the smallest in operand lead, ties broken by the other
// operands in turn (magnitudes: a reversed read is still a walk through
// memory).
func memoryOrder(shape []int64, strides [][]int64, lead int) []int {
	var dims []int
	for i, n := range shape {
		if n != 1 {
			dims = append(dims, i)
		}
	}
	ops := []int{lead}
	for j := range strides {
		if j != lead {
			ops = append(ops, j)
		}
	}
	inside := func(a, b int) bool { // dim a goes inside dim b
		for _, j := range ops {
			if x, y := abs(strides[j][a]), abs(strides[j][b]); x != y {
				return x < y
			}
		}
		return false
	}
	for a := 1; a < len(dims); a++ { // insertion sort, stable; ndim <= 8
		for b := a; b > 0 && inside(dims[b-1], dims[b]); b-- {
			dims[b], dims[b-1] = dims[b-1], dims[b]
		}
	}
	return dims
}

// wireWalk builds the walk of the box in logical row-major order: the order
// of a message's bytes, which both ends of it share.
func wireWalk(shape []int64, strides [][]int64, base []int64) walk {
	var dims []int
	for i, n := range shape {
		if n != 1 {
			dims = append(dims, i)
		}
	}
	return buildWalk(shape, strides, base, dims)
}

func abs(x int64) int64 {
	if x < 0 {
		return -x
	}
	return x
}

// buildWalk builds the walk that visits dims (all of shape's dims of size
// other than 1) outermost first.
func buildWalk(shape []int64, strides [][]int64, base []int64, dims []int) walk {
	k := len(strides)
	w := walk{base: append([]int64(nil), base...), strides: make([][]int64, k), step: make([]int64, k)}
	for _, n := range shape {
		if n == 0 {
			return w // run == 0: nothing to visit
		}
	}
	// Merge dim i into the next one where every operand is contiguous
	// across them.
	type d struct {
		n int64
		s []int64
	}
	var ds []d
	for _, i := range dims {
		s := make([]int64, k)
		for j := range strides {
			s[j] = strides[j][i]
		}
		if len(ds) > 0 {
			p := &ds[len(ds)-1]
			merge := true
			for j := range s {
				if p.s[j] != s[j]*shape[i] {
					merge = false
					break
				}
			}
			if merge {
				p.n *= shape[i]
				copy(p.s, s)
				continue
			}
		}
		ds = append(ds, d{shape[i], s})
	}
	w.run = 1
	if len(ds) > 0 {
		last := ds[len(ds)-1]
		unit := true
		for _, s := range last.s {
			unit = unit && s == 1
		}
		if unit {
			w.run = last.n
			ds = ds[:len(ds)-1]
		}
	}
	for _, x := range ds {
		w.outer = append(w.outer, x.n)
		for j := range w.strides {
			w.strides[j] = append(w.strides[j], x.s[j])
		}
	}
	w.off = make([]int64, k)
	w.idx = make([]int64, len(w.outer))
	return w
}

// runs is the number of runs the walk visits.
func (w *walk) runs() int64 {
	if w.run == 0 {
		return 0
	}
	n := int64(1)
	for _, x := range w.outer {
		n *= x
	}
	return n
}

// rows calls fn for each row of the walk: n runs, the first at every
// operand's element offset off, the next ones step elements apart per
// operand (the innermost outer dim). Kernels loop over a row themselves, so
// short runs cost no call each. The slices are reused between calls.
func (w *walk) rows(fn func(off []int64, n int64, step []int64)) {
	last := len(w.outer) - 1
	if last < 0 {
		if w.run > 0 {
			copy(w.off, w.base)
			fn(w.off, 1, w.step)
		}
		return
	}
	for j := range w.step {
		w.step[j] = w.strides[j][last]
	}
	w.outside(1, func(off []int64) { fn(off, w.outer[last], w.step) })
}

// outside calls fn with the operands' element offsets at every index of
// the walk's outer dims but the k innermost ones, which fn walks itself.
func (w *walk) outside(k int, fn func(off []int64)) {
	if w.run == 0 {
		return
	}
	off := w.off
	copy(off, w.base)
	n := len(w.outer) - k
	idx := w.idx[:n]
	clear(idx)
	for {
		fn(off)
		i := n - 1
		for ; i >= 0; i-- {
			idx[i]++
			for j := range off {
				off[j] += w.strides[j][i]
			}
			if idx[i] < w.outer[i] {
				break
			}
			for j := range off {
				off[j] -= w.strides[j][i] * idx[i]
			}
			idx[i] = 0
		}
		if i < 0 {
			return
		}
	}
}

// each calls fn with every operand's element offset of each run, in order.
// The offsets slice is reused between calls.
func (w *walk) each(fn func(off []int64)) {
	at := make([]int64, len(w.base))
	w.rows(func(off []int64, n int64, step []int64) {
		copy(at, off)
		for r := int64(0); r < n; r++ {
			fn(at)
			for j := range at {
				at[j] += step[j]
			}
		}
	})
}

// segments lists the byte ranges of operand 0 of a single-operand walk, in
// base buffer base.
func (w *walk) segments(elem, base int) []transport.Segment {
	segs := make([]transport.Segment, 0, w.runs())
	n := w.run * int64(elem)
	w.each(func(off []int64) {
		o := off[0] * int64(elem)
		if k := len(segs); k > 0 && segs[k-1].Off+segs[k-1].Len == o {
			segs[k-1].Len += n // runs that happen to touch
			return
		}
		segs = append(segs, transport.Segment{Base: base, Off: o, Len: n})
	})
	return segs
}
