package halo

import (
	"bytes"
	"math/rand"
	"slices"
	"testing"
	"unsafe"
)

func TestCopyLarge(t *testing.T) {
	rng := rand.New(rand.NewSource(10))
	src := make([]byte, 1<<16+200)
	rng.Read(src)
	for it := 0; it < 500; it++ {
		so, do, n := rng.Intn(100), rng.Intn(100), rng.Intn(1<<16)
		dst := make([]byte, n+do+100)
		rng.Read(dst)
		want := append([]byte(nil), dst...)
		copy(want[do:do+n], src[so:so+n])
		copyLarge(dst[do:do+n], src[so:so+n])
		if !bytes.Equal(dst, want) {
			t.Fatalf("src+%d dst+%d n=%d: differs", so, do, n)
		}
	}
}

func BenchmarkCopyLarge8MiB(b *testing.B) {
	dst, src := make([]byte, 8<<20), make([]byte, 8<<20)
	b.SetBytes(8 << 20)
	for i := 0; i < b.N; i++ {
		copyLarge(dst, src)
	}
}

func BenchmarkCopy8MiB(b *testing.B) {
	dst, src := make([]byte, 8<<20), make([]byte, 8<<20)
	b.SetBytes(8 << 20)
	for i := 0; i < b.N; i++ {
		copy(dst, src)
	}
}

// The executor's row kernels (word loops for short runs, memmove for long
// ones, strided additions) must touch exactly the elements of the walk and
// compute what an element-by-element loop computes, for random layouts in
// random dim orders (channels-last-like permutations among them), reversed
// and repeated (stride 0) source dims as the padding modes make, and odd
// alignments.
func TestExecutorAgainstBruteForce(t *testing.T) {
	rng := rand.New(rand.NewSource(11))
	var x cpu
	for it := 0; it < 3000; it++ {
		d := DType(rng.Intn(4))
		elem := d.Size()
		nd := 1 + rng.Intn(5)
		shape := make([]int64, nd)
		for i := range shape {
			shape[i] = int64(1 + rng.Intn(5))
			if rng.Intn(4) == 0 {
				shape[i] = int64(1 + rng.Intn(40)) // long runs, long rows
			}
		}
		if Numel(shape) > 1<<14 {
			continue
		}
		ds, ss := RandomStrides(rng, shape), RandomStrides(rng, shape)
		if rng.Intn(2) == 0 {
			ss = slices.Clone(ds) // same layout: the walk coalesces
		}
		dbase, sbase := int64(rng.Intn(3)), int64(rng.Intn(3))
		if rng.Intn(4) == 0 { // one source dim reversed or repeated
			k := rng.Intn(nd)
			if rng.Intn(2) == 0 {
				sbase += (shape[k] - 1) * ss[k]
				ss[k] = -ss[k]
			} else {
				ss[k] = 0
			}
		}
		dext, _ := extent(shape, ds, elem)
		sext, _ := extent(shape, absAll(ss), elem)
		dbuf := make([]byte, dext+int64(dbase+8)*int64(elem))
		sbuf := make([]byte, sext+int64(sbase+8)*int64(elem))
		for i := 0; i+elem <= len(dbuf); i += elem {
			putBits(dbuf[i:], elem, RandomValue(rng, d))
		}
		for i := 0; i+elem <= len(sbuf); i += elem {
			putBits(sbuf[i:], elem, RandomValue(rng, d))
		}
		op := rng.Intn(4)
		want := slices.Clone(dbuf)
		idx := make([]int64, nd)
		for i := int64(0); i < Numel(shape); i++ {
			Unravel(shape, i, idx)
			do := (dbase + OffsetOf(idx, ds)) * int64(elem)
			so := (sbase + OffsetOf(idx, ss)) * int64(elem)
			a, b := getBits(want[do:], elem), getBits(sbuf[so:], elem)
			switch op {
			case 0:
				a = b
			case 1:
				a = 0
			case 2:
				a = addScalar(d, a, b)
			case 3:
				a = addScalar(d, a, 0)
			}
			putBits(want[do:], elem, a)
		}
		dp, sp := unsafe.Pointer(&dbuf[0]), unsafe.Pointer(&sbuf[0])
		if op == 1 || op == 3 {
			w := newWalk(shape, [][]int64{ds}, []int64{dbase})
			if op == 1 {
				x.zero(&w, elem, dp)
			} else {
				x.addZero(&w, d, dp)
			}
		} else {
			w := newWalk(shape, [][]int64{ds, ss}, []int64{dbase, sbase})
			if op == 0 {
				x.copy(&w, elem, dp, sp)
			} else {
				x.add(&w, d, dp, sp)
			}
		}
		if !bytes.Equal(dbuf, want) {
			t.Fatalf("%v op %d shape %v dst strides %v+%d src strides %v+%d: differs from the element loop", d, op, shape, ds, dbase, ss, sbase)
		}
	}
}

func absAll(s []int64) []int64 {
	a := make([]int64, len(s))
	for i, x := range s {
		a[i] = abs(x)
	}
	return a
}
