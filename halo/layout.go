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
// different strides; runs come in logical row-major order, which is the order
// of bytes on the wire, so sender and receiver agree whatever their layouts.
type walk struct {
	run     int64     // elements per run
	outer   []int64   // coalesced outer shape, row-major
	strides [][]int64 // per operand, per outer dim, in elements
	base    []int64   // per operand, offset of the first element, in elements
	off     []int64   // scratch for each: a walk is used by one goroutine at a time
	idx     []int64
}

// newWalk builds the walk of the box shape over operands with the given
// strides and base offsets (in elements).
func newWalk(shape []int64, strides [][]int64, base []int64) walk {
	k := len(strides)
	w := walk{base: append([]int64(nil), base...), strides: make([][]int64, k)}
	for _, n := range shape {
		if n == 0 {
			return w // run == 0: nothing to visit
		}
	}
	// Drop size-1 dims, then merge dim i into i+1 where every operand is
	// contiguous across them.
	var dims []int
	for i, n := range shape {
		if n != 1 {
			dims = append(dims, i)
		}
	}
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

// each calls fn with every operand's element offset of each run, in order.
// The offsets slice is reused between calls.
func (w *walk) each(fn func(off []int64)) {
	if w.run == 0 {
		return
	}
	off, idx := w.off, w.idx
	copy(off, w.base)
	clear(idx)
	for {
		fn(off)
		i := len(idx) - 1
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
