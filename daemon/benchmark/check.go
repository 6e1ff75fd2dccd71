package benchmark

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/halo-cp/halo/halo"
)

// With --check every iteration's data is verified on every rank.
//
// Forward: x holds, at every element, a hash of (iteration, outer index,
// global slice, inner index); every rank can compute what any other rank
// holds, so a received halo is checked exactly, bit for bit, whatever the
// dtype (forward only moves bytes). Slices outside the global sequence
// must be zero. The halo slots of out are poisoned before each call, and the
// values change every iteration, so a stale or missing message shows.
//
// Backward: grad_out holds small integers drawn from a hash of (rank,
// iteration, outer index, global position, inner index); the expected grad_x
// is the sum, over every slot of every rank's out that shows a slice (its
// own place, and the padding slots copied from it), of that slot's value.
// The integers are small enough that every partial sum is exact in the
// dtype, so the order of the additions cannot change the result and the
// check is bit-exact too.

// view is a tensor seen as [pre, n, post] around the halo dim: pre is the
// product of the dims before it, post of the dims after it (contiguous).
type view struct {
	base      unsafe.Pointer
	pre, n    int64
	post      int64
	preStride int64 // elements between consecutive outer indices
	elem      int64
}

func (v view) row(a, i int64) unsafe.Pointer {
	return unsafe.Add(v.base, (a*v.preStride+i*v.post)*v.elem)
}

// checker knows the global layout of one case.
type checker struct {
	dt      halo.DType
	pad     halo.Padding
	rank    int
	left    int64
	right   int64
	off     []int64 // every rank's first global slice
	lens    []int64
	total   int64
	contrib [][]slot // for each local slice: the slots of every rank's out that show it
	gradMax int64    // backward values are in [-gradMax, gradMax]
}

// slot is global position g of rank's out.
type slot struct {
	rank int
	g    int64
}

// exactLimit is the largest integer n such that every integer in [-n, n]
// is exact in the dtype.
func exactLimit(dt halo.DType) int64 {
	switch dt {
	case halo.BFloat16:
		return 1 << 8
	case halo.Float16:
		return 1 << 11
	case halo.Float32:
		return 1 << 24
	}
	return 1 << 53
}

func newChecker(dt halo.DType, pad halo.Padding, rank int, lens []int64, left, right int64) *checker {
	c := &checker{dt: dt, pad: pad, rank: rank, left: left, right: right, lens: lens, off: make([]int64, len(lens))}
	for q, n := range lens {
		c.off[q] = c.total
		c.total += n
	}
	// Every slot of every rank's out window [off_q - left, off_q + n_q +
	// right), by the global slice it shows; most is the largest count.
	me := c.off[rank]
	c.contrib = make([][]slot, lens[rank])
	count := make([]int64, c.total)
	most := int64(1)
	for q, n := range lens {
		for g := c.off[q] - left; g < c.off[q]+n+right; g++ {
			s, ok := pad.Source(g, c.total)
			if !ok {
				continue
			}
			count[s]++
			most = max(most, count[s])
			if s >= me && s < me+lens[rank] {
				c.contrib[s-me] = append(c.contrib[s-me], slot{q, g})
			}
		}
	}
	c.gradMax = min(64, exactLimit(dt)/most)
	return c
}

func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// forwardKey seeds the values of one row (outer index a, global slice g).
func forwardKey(it int, a, g int64) uint64 {
	return mix(mix(uint64(it)*0x100000001b3+uint64(a))*0x9e3779b97f4a7c15 + uint64(g))
}

func gradKey(it, rank int, a, g int64) uint64 {
	return mix(mix(mix(uint64(it)^0x5bd1e995)*31+uint64(rank))*0x100000001b3+uint64(a)) ^ mix(uint64(g)+0x632be59bd9b4e019)
}

func (c *checker) gradValue(key uint64, b int64) int64 {
	if c.gradMax == 0 {
		return 0
	}
	return int64(mix(key+uint64(b))%uint64(2*c.gradMax+1)) - c.gradMax
}

// bits is the dtype's bit pattern of a small integer.
func (c *checker) bits(v int64) uint64 {
	switch c.dt {
	case halo.Float32:
		return uint64(math.Float32bits(float32(v)))
	case halo.Float64:
		return math.Float64bits(float64(v))
	case halo.Float16:
		return uint64(halo.F32ToF16(float32(v)))
	case halo.BFloat16:
		return uint64(halo.F32ToBF16(float32(v)))
	}
	return 0
}

// mismatch describes the first wrong element a rank saw.
type mismatch struct {
	tensor    string
	a, i, b   int64
	global    int64
	got, want uint64
	from      string
}

func (m *mismatch) String() string {
	return fmt.Sprintf("%s[outer %d, slice %d, inner %d] (global slice %d, %s) = %#x, want %#x",
		m.tensor, m.a, m.i, m.b, m.global, m.from, m.got, m.want)
}

type word interface{ ~uint16 | ~uint32 | ~uint64 }

func rowOf[T word](v view, a, i int64) []T {
	return unsafe.Slice((*T)(v.row(a, i)), v.post)
}

// fillForward writes iteration it's values into x, and poisons the slices
// of out that the call must write (all of them, or only the halo slots
// when x is out's interior).
func fillForward[T word](c *checker, it int, x, out view, inPlace bool) {
	me := c.off[c.rank]
	for a := int64(0); a < x.pre; a++ {
		for i := int64(0); i < x.n; i++ {
			key := forwardKey(it, a, me+i)
			r := rowOf[T](x, a, i)
			for b := range r {
				r[b] = T(mix(key + uint64(b)))
			}
		}
	}
	for a := int64(0); a < out.pre; a++ {
		for j := int64(0); j < out.n; j++ {
			if inPlace && j >= c.left && j < out.n-c.right {
				continue
			}
			r := rowOf[T](out, a, j)
			for b := range r {
				r[b] = ^T(0)
			}
		}
	}
}

// verifyForward counts the wrong elements of out.
func verifyForward[T word](c *checker, it int, out view) (wrong int64, first *mismatch) {
	start := c.off[c.rank] - c.left
	for a := int64(0); a < out.pre; a++ {
		for j := int64(0); j < out.n; j++ {
			g := start + j
			r := rowOf[T](out, a, j)
			s, ok := c.pad.Source(g, c.total)
			if !ok {
				for b, got := range r {
					if got != 0 {
						wrong++
						if first == nil {
							first = &mismatch{tensor: "out", a: a, i: j, b: int64(b), global: g, got: uint64(got), from: "zero padding"}
						}
					}
				}
				continue
			}
			key := forwardKey(it, a, s)
			for b, got := range r {
				if want := T(mix(key + uint64(b))); got != want {
					wrong++
					if first == nil {
						from := "from rank " + fmt.Sprint(c.owner(s))
						if s != g {
							from += fmt.Sprintf(" (%v padding of global slice %d)", c.pad, s)
						}
						first = &mismatch{tensor: "out", a: a, i: j, b: int64(b), global: g, got: uint64(got), want: uint64(want), from: from}
					}
				}
			}
		}
	}
	return wrong, first
}

// owner is the rank that holds global slice g.
func (c *checker) owner(g int64) int {
	for q := range c.lens {
		if g >= c.off[q] && g < c.off[q]+c.lens[q] {
			return q
		}
	}
	return -1
}

// fillBackward writes iteration it's gradient values into grad_out.
func fillBackward[T word](c *checker, it int, gradOut view) {
	start := c.off[c.rank] - c.left
	for a := int64(0); a < gradOut.pre; a++ {
		for j := int64(0); j < gradOut.n; j++ {
			key := gradKey(it, c.rank, a, start+j)
			r := rowOf[T](gradOut, a, j)
			for b := range r {
				r[b] = T(c.bits(c.gradValue(key, int64(b))))
			}
		}
	}
}

// verifyBackward counts the wrong elements of grad_x.
func verifyBackward[T word](c *checker, it int, gradX view) (wrong int64, first *mismatch) {
	me := c.off[c.rank]
	keys := make([]uint64, 0, 8)
	for a := int64(0); a < gradX.pre; a++ {
		for i := int64(0); i < gradX.n; i++ {
			g := me + i
			keys = keys[:0]
			for _, sl := range c.contrib[i] {
				keys = append(keys, gradKey(it, sl.rank, a, sl.g))
			}
			r := rowOf[T](gradX, a, i)
			for b, got := range r {
				var sum int64
				for _, k := range keys {
					sum += c.gradValue(k, int64(b))
				}
				if want := T(c.bits(sum)); got != want {
					wrong++
					if first == nil {
						first = &mismatch{tensor: "grad_x", a: a, i: i, b: int64(b), global: g, got: uint64(got), want: uint64(want),
							from: fmt.Sprintf("sum of the gradients of (rank, global position) %v", c.contrib[i])}
					}
				}
			}
		}
	}
	return wrong, first
}

// The dtype-dispatching entry points.

func (c *checker) fillForward(it int, x, out view, inPlace bool) {
	switch x.elem {
	case 2:
		fillForward[uint16](c, it, x, out, inPlace)
	case 4:
		fillForward[uint32](c, it, x, out, inPlace)
	default:
		fillForward[uint64](c, it, x, out, inPlace)
	}
}

func (c *checker) verifyForward(it int, out view) (int64, *mismatch) {
	switch out.elem {
	case 2:
		return verifyForward[uint16](c, it, out)
	case 4:
		return verifyForward[uint32](c, it, out)
	}
	return verifyForward[uint64](c, it, out)
}

func (c *checker) fillBackward(it int, gradOut view) {
	switch gradOut.elem {
	case 2:
		fillBackward[uint16](c, it, gradOut)
	case 4:
		fillBackward[uint32](c, it, gradOut)
	default:
		fillBackward[uint64](c, it, gradOut)
	}
}

func (c *checker) verifyBackward(it int, gradX view) (int64, *mismatch) {
	switch gradX.elem {
	case 2:
		return verifyBackward[uint16](c, it, gradX)
	case 4:
		return verifyBackward[uint32](c, it, gradX)
	}
	return verifyBackward[uint64](c, it, gradX)
}
