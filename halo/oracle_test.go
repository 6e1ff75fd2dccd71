package halo

import (
	"math"
	"math/rand"
	"unsafe"
)

// A logical tensor for tests: element bit patterns in row-major order,
// independent of any memory layout.
type logical struct {
	shape []int64
	bits  []uint64
}

func numel(shape []int64) int64 {
	n := int64(1)
	for _, s := range shape {
		n *= s
	}
	return n
}

// unravel turns a row-major linear index into a multi-index.
func unravel(shape []int64, i int64, idx []int64) {
	for d := len(shape) - 1; d >= 0; d-- {
		idx[d] = i % shape[d]
		i /= shape[d]
	}
}

func offsetOf(idx, strides []int64) int64 {
	var o int64
	for d := range idx {
		o += idx[d] * strides[d]
	}
	return o
}

// randomStrides lays shape out in a random dimension order with random gaps
// between dimensions: non-contiguous, never self-overlapping.
func randomStrides(rng *rand.Rand, shape []int64) []int64 {
	if rng.Intn(3) == 0 {
		return ContiguousStrides(shape)
	}
	order := rng.Perm(len(shape))
	st := make([]int64, len(shape))
	acc := int64(1 + rng.Intn(2))
	for i := len(order) - 1; i >= 0; i-- {
		d := order[i]
		st[d] = acc
		acc *= shape[d] + int64(rng.Intn(2))
		if acc == 0 {
			acc = 1
		}
	}
	return st
}

// memory is a buffer for one tensor in a given layout.
type memory struct {
	buf     []byte
	base    int64 // byte offset of element 0 in buf
	strides []int64
	elem    int
}

func newMemory(shape, strides []int64, elem int, pad int64) *memory {
	ext, err := extent(shape, strides, elem)
	if err != nil {
		panic(err)
	}
	return &memory{buf: make([]byte, ext+2*pad+8), base: pad, strides: strides, elem: elem}
}

func (m *memory) ptr() unsafe.Pointer { return unsafe.Pointer(&m.buf[m.base]) }

func (m *memory) store(t logical) {
	idx := make([]int64, len(t.shape))
	for i := range t.bits {
		unravel(t.shape, int64(i), idx)
		putBits(m.buf[m.base+offsetOf(idx, m.strides)*int64(m.elem):], m.elem, t.bits[i])
	}
}

func (m *memory) load(shape []int64) logical {
	t := logical{shape: shape, bits: make([]uint64, numel(shape))}
	idx := make([]int64, len(shape))
	for i := range t.bits {
		unravel(shape, int64(i), idx)
		t.bits[i] = getBits(m.buf[m.base+offsetOf(idx, m.strides)*int64(m.elem):], m.elem)
	}
	return t
}

func putBits(b []byte, elem int, v uint64) {
	for i := 0; i < elem; i++ {
		b[i] = byte(v >> (8 * i))
	}
}

func getBits(b []byte, elem int) uint64 {
	var v uint64
	for i := 0; i < elem; i++ {
		v |= uint64(b[i]) << (8 * i)
	}
	return v
}

// randomValue draws a finite value of dtype d, negative zero included, so
// that rounding and the +0 rule are exercised.
func randomValue(rng *rand.Rand, d DType) uint64 {
	if rng.Intn(20) == 0 {
		switch d {
		case Float32:
			return 0x80000000
		case Float64:
			return 1 << 63
		default:
			return 0x8000
		}
	}
	f := rng.NormFloat64() * math.Pow(2, float64(rng.Intn(12)-6))
	switch d {
	case Float32:
		return uint64(math.Float32bits(float32(f)))
	case Float64:
		return math.Float64bits(f)
	case Float16:
		return uint64(F32ToF16(float32(f)))
	}
	return uint64(F32ToBF16(float32(f)))
}

// addScalar is the test's own statement of the arithmetic: what torch's
// add_ does for one element.
func addScalar(d DType, a, b uint64) uint64 {
	switch d {
	case Float32:
		return uint64(math.Float32bits(math.Float32frombits(uint32(a)) + math.Float32frombits(uint32(b))))
	case Float64:
		return math.Float64bits(math.Float64frombits(a) + math.Float64frombits(b))
	case Float16:
		return uint64(F32ToF16(f16ToF32Slow(uint16(a)) + f16ToF32Slow(uint16(b))))
	}
	return uint64(F32ToBF16(BF16ToF32(uint16(a)) + BF16ToF32(uint16(b))))
}

// oracle computes every rank's forward output and input gradient from the
// whole global sequence, element by element, straight from the semantics.
func oracle(d DType, xs, grads []logical, dim int, L, R int64) (outs, gradXs []logical) {
	W := len(xs)
	off := make([]int64, W+1)
	for r := range xs {
		off[r+1] = off[r] + xs[r].shape[dim]
	}
	N := off[W]
	// valueAt returns the global element at position P along dim with the
	// other coordinates taken from idx.
	valueAt := func(P int64, idx []int64) uint64 {
		for q := 0; q < W; q++ {
			if P >= off[q] && P < off[q+1] {
				j := append([]int64(nil), idx...)
				j[dim] = P - off[q]
				return xs[q].bits[offsetOf(j, ContiguousStrides(xs[q].shape))]
			}
		}
		panic("no owner")
	}
	for r := 0; r < W; r++ {
		n := xs[r].shape[dim]
		oshape := append([]int64(nil), xs[r].shape...)
		oshape[dim] += L + R
		out := logical{shape: oshape, bits: make([]uint64, numel(oshape))}
		idx := make([]int64, len(oshape))
		for i := range out.bits {
			unravel(oshape, int64(i), idx)
			P := off[r] - L + idx[dim]
			if P >= 0 && P < N {
				out.bits[i] = valueAt(P, idx)
			}
		}
		outs = append(outs, out)

		gx := logical{shape: xs[r].shape, bits: make([]uint64, numel(xs[r].shape))}
		for i := range gx.bits {
			unravel(xs[r].shape, int64(i), idx[:len(xs[r].shape)])
			j := idx[:len(xs[r].shape)]
			P := off[r] + j[dim]
			gAt := func(s int) uint64 { // rank s's grad_out at global position P
				k := append([]int64(nil), j...)
				k[dim] = P - off[s] + L
				return grads[s].bits[offsetOf(k, ContiguousStrides(grads[s].shape))]
			}
			k := append([]int64(nil), j...)
			k[dim] += L
			v := grads[r].bits[offsetOf(k, ContiguousStrides(grads[r].shape))]
			for s := r + 1; s < W; s++ { // used as left halo by ranks to the right
				if P >= off[s]-L && P < off[s] {
					v = addScalar(d, v, gAt(s))
				}
			}
			if r == W-1 && j[dim] >= n-L {
				v = addScalar(d, v, 0)
			}
			for s := r - 1; s >= 0; s-- { // used as right halo by ranks to the left
				if P >= off[s+1] && P < off[s+1]+R {
					v = addScalar(d, v, gAt(s))
				}
			}
			if r == 0 && j[dim] < R {
				v = addScalar(d, v, 0)
			}
			gx.bits[i] = v
		}
		gradXs = append(gradXs, gx)
	}
	return
}
