package halo

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand"
	"os"
	"sync"
	"unsafe"
)

// A Logical tensor for tests: element bit patterns in row-major order,
// independent of any memory layout.
type Logical struct {
	Shape []int64
	Bits  []uint64
}

func Numel(shape []int64) int64 {
	n := int64(1)
	for _, s := range shape {
		n *= s
	}
	return n
}

// unravel turns a row-major linear index into a multi-index.
func Unravel(shape []int64, i int64, idx []int64) {
	for d := len(shape) - 1; d >= 0; d-- {
		idx[d] = i % shape[d]
		i /= shape[d]
	}
}

func OffsetOf(idx, strides []int64) int64 {
	var o int64
	for d := range idx {
		o += idx[d] * strides[d]
	}
	return o
}

// randomStrides lays shape out in a random dimension order with random gaps
// between dimensions: non-contiguous, never self-overlapping.
func RandomStrides(rng *rand.Rand, shape []int64) []int64 {
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
type Memory struct {
	buf     []byte
	base    int64 // byte offset of element 0 in buf
	strides []int64
	elem    int
	shape   []int64
}

func NewMemory(shape, strides []int64, elem int, pad int64) *Memory {
	ext, err := extent(shape, strides, elem)
	if err != nil {
		panic(err)
	}
	return &Memory{buf: make([]byte, ext+2*pad+8), base: pad, strides: strides, elem: elem, shape: shape}
}

func (m *Memory) Ptr() unsafe.Pointer { return unsafe.Pointer(&m.buf[m.base]) }

// Shape is the logical shape the memory was made for, when known.
func (m *Memory) Shape() []int64 { return m.shape }

// Fill sets every byte of the buffer, padding included.
func (m *Memory) Fill(b byte) {
	for i := range m.buf {
		m.buf[i] = b
	}
}

// View is a tensor inside m's buffer, off elements from m's element 0.
func (m *Memory) View(off int64, strides []int64) *Memory {
	return &Memory{buf: m.buf, base: m.base + off*int64(m.elem), strides: strides, elem: m.elem}
}

func (m *Memory) Store(t Logical) {
	idx := make([]int64, len(t.Shape))
	for i := range t.Bits {
		Unravel(t.Shape, int64(i), idx)
		putBits(m.buf[m.base+OffsetOf(idx, m.strides)*int64(m.elem):], m.elem, t.Bits[i])
	}
}

func (m *Memory) Load(shape []int64) Logical {
	t := Logical{Shape: shape, Bits: make([]uint64, Numel(shape))}
	idx := make([]int64, len(shape))
	for i := range t.Bits {
		Unravel(shape, int64(i), idx)
		t.Bits[i] = getBits(m.buf[m.base+OffsetOf(idx, m.strides)*int64(m.elem):], m.elem)
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
func RandomValue(rng *rand.Rand, d DType) uint64 {
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
func Oracle(d DType, xs, grads []Logical, dim int, L, R int64) (outs, gradXs []Logical) {
	return OraclePadding(d, xs, grads, dim, L, R, PadZeros)
}

// OraclePadding is Oracle under a padding mode. Other than zeros it is the
// definition: rank r's output is F.pad(global, (L, R), mode) sliced to
// [off_r, off_r + n_r + L + R); the gradient is F.pad's backward (torch
// 1.13's order, from +0) of the gathered padded gradient, whose slots sum
// the ranks' grad_out in the documented order.
func OraclePadding(d DType, xs, grads []Logical, dim int, L, R int64, mode Padding) (outs, gradXs []Logical) {
	if mode != PadZeros {
		return oracleModes(d, xs, grads, dim, L, R, mode)
	}
	W := len(xs)
	off := make([]int64, W+1)
	for r := range xs {
		off[r+1] = off[r] + xs[r].Shape[dim]
	}
	N := off[W]
	outs = oracleOuts(xs, dim, L, R, func(g int64) int64 {
		if g >= 0 && g < N {
			return g
		}
		return -1
	})
	for r := 0; r < W; r++ {
		n := xs[r].Shape[dim]
		idx := make([]int64, len(xs[r].Shape))
		gx := Logical{Shape: xs[r].Shape, Bits: make([]uint64, Numel(xs[r].Shape))}
		for i := range gx.Bits {
			Unravel(xs[r].Shape, int64(i), idx[:len(xs[r].Shape)])
			j := idx[:len(xs[r].Shape)]
			P := off[r] + j[dim]
			gAt := func(s int) uint64 { // rank s's grad_out at global position P
				k := append([]int64(nil), j...)
				k[dim] = P - off[s] + L
				return grads[s].Bits[OffsetOf(k, ContiguousStrides(grads[s].Shape))]
			}
			k := append([]int64(nil), j...)
			k[dim] += L
			v := grads[r].Bits[OffsetOf(k, ContiguousStrides(grads[r].Shape))]
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
			gx.Bits[i] = v
		}
		gradXs = append(gradXs, gx)
	}
	return
}

// oracleOuts is every rank's forward output: padded global position g shows
// global slice src(g), or zero where that is -1.
func oracleOuts(xs []Logical, dim int, L, R int64, src func(g int64) int64) (outs []Logical) {
	off := []int64{0}
	for r := range xs {
		off = append(off, off[r]+xs[r].Shape[dim])
	}
	for r := range xs {
		oshape := append([]int64(nil), xs[r].Shape...)
		oshape[dim] += L + R
		out := Logical{Shape: oshape, Bits: make([]uint64, Numel(oshape))}
		idx := make([]int64, len(oshape))
		for i := range out.Bits {
			Unravel(oshape, int64(i), idx)
			s := src(off[r] - L + idx[dim])
			for q := range xs {
				if s >= off[q] && s < off[q+1] {
					j := append([]int64(nil), idx...)
					j[dim] = s - off[q]
					out.Bits[i] = xs[q].Bits[OffsetOf(j, ContiguousStrides(xs[q].Shape))]
				}
			}
		}
		outs = append(outs, out)
	}
	return outs
}

func oracleModes(d DType, xs, grads []Logical, dim int, L, R int64, mode Padding) (outs, gradXs []Logical) {
	W := len(xs)
	off := make([]int64, W+1)
	for r := range xs {
		off[r+1] = off[r] + xs[r].Shape[dim]
	}
	T := off[W]
	src := func(g int64) int64 { // the global slice that padded position g shows
		switch {
		case g >= 0 && g < T:
			return g
		case mode == PadReplicate:
			return min(max(g, 0), T-1)
		case mode == PadReflect && g < 0:
			return -g
		case mode == PadReflect:
			return 2*(T-1) - g
		}
		return ((g % T) + T) % T
	}
	at := func(t Logical, first int64, g int64, idx []int64) uint64 { // t's slice g-first, other coordinates idx's
		j := append([]int64(nil), idx...)
		j[dim] = g - first
		return t.Bits[OffsetOf(j, ContiguousStrides(t.Shape))]
	}
	owner := func(g int64) int {
		for q := 0; q < W; q++ {
			if g >= off[q] && g < off[q+1] {
				return q
			}
		}
		panic("no owner")
	}
	covers := func(s int, g int64) bool { return g >= off[s]-L && g < off[s+1]+R }
	// gp is the gathered padded gradient at global position g: the owner's
	// own, the ranks to the right nearest first, then those to the left;
	// beyond the ends, the ranks nearest the end first.
	gp := func(g int64, idx []int64) uint64 {
		var order []int
		switch {
		case g < 0:
			for s := 0; s < W; s++ {
				order = append(order, s)
			}
		case g >= T:
			for s := W - 1; s >= 0; s-- {
				order = append(order, s)
			}
		default:
			o := owner(g)
			order = append(order, o)
			for s := o + 1; s < W; s++ {
				order = append(order, s)
			}
			for s := o - 1; s >= 0; s-- {
				order = append(order, s)
			}
		}
		var v uint64
		first := true
		for _, s := range order {
			if !covers(s, g) {
				continue
			}
			if first {
				v, first = at(grads[s], off[s]-L, g, idx), false
			} else {
				v = addScalar(d, v, at(grads[s], off[s]-L, g, idx))
			}
		}
		return v
	}
	outs = oracleOuts(xs, dim, L, R, src)
	for r := 0; r < W; r++ {
		idx := make([]int64, len(xs[r].Shape))
		gx := Logical{Shape: xs[r].Shape, Bits: make([]uint64, Numel(xs[r].Shape))}
		for i := range gx.Bits {
			Unravel(xs[r].Shape, int64(i), idx)
			p := off[r] + idx[dim]
			v := uint64(0) // torch's backward starts from +0
			if mode == PadCircular {
				// Its own, the right slot's copy, the left slot's; then +0
				// where torch adds one (its table, not a rule of ours).
				v = gp(p, idx)
				if p < R {
					v = addScalar(d, v, gp(p+T, idx))
				}
				if p >= T-L {
					v = addScalar(d, v, gp(p-T, idx))
				}
				if circularPlusZero(T, L, R, p) {
					v = addScalar(d, v, 0)
				}
			} else { // every position showing p, in increasing order
				for g := -L; g < T+R; g++ {
					if src(g) == p {
						v = addScalar(d, v, gp(g, idx))
					}
				}
			}
			gx.Bits[i] = v
		}
		gradXs = append(gradXs, gx)
	}
	return
}

// circularZeros is testdata/circular_zeros.json, written by torch
// (circular_zeros.py): for a global length T and halos L and R, '+' at the
// slices to whose gradient torch's circular padding backward adds +0.
var circularZeros = sync.OnceValue(func() map[[3]int64]string {
	raw, err := os.ReadFile("testdata/circular_zeros.json")
	if err != nil {
		panic(err)
	}
	var golden struct {
		Cases [][4]any `json:"cases"`
	}
	if err := json.Unmarshal(raw, &golden); err != nil {
		panic(err)
	}
	table := map[[3]int64]string{}
	for _, c := range golden.Cases {
		table[[3]int64{int64(c[0].(float64)), int64(c[1].(float64)), int64(c[2].(float64))}] = c[3].(string)
	}
	return table
})

func circularPlusZero(T, L, R, p int64) bool {
	mask, ok := circularZeros()[[3]int64{T, L, R}]
	if !ok {
		panic(fmt.Sprintf("testdata/circular_zeros.json has no case T %d L %d R %d: raise its MAX_T", T, L, R))
	}
	return mask[p] == '+'
}
