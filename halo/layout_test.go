package halo

import (
	"math"
	"math/rand"
	"slices"
	"testing"
	"unsafe"
)

// A wire walk must visit exactly the elements of the box, in logical
// row-major order, for every operand at once; a local walk the same
// elements, each once, in any order.
func TestWalkAgainstBruteForce(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	for it := 0; it < 2000; it++ {
		nd := 1 + rng.Intn(6)
		shape := make([]int64, nd)
		for i := range shape {
			shape[i] = int64(rng.Intn(4))
			if rng.Intn(5) > 0 && shape[i] == 0 {
				shape[i] = 1
			}
		}
		k := 1 + rng.Intn(3)
		strides := make([][]int64, k)
		base := make([]int64, k)
		for j := range strides {
			strides[j] = RandomStrides(rng, shape)
			base[j] = int64(rng.Intn(10))
		}
		total := Numel(shape)
		want := make([][]int64, total)
		idx := make([]int64, nd)
		for i := range want {
			Unravel(shape, int64(i), idx)
			want[i] = make([]int64, k)
			for j := range strides {
				want[i][j] = base[j] + OffsetOf(idx, strides[j])
			}
		}
		for _, local := range []bool{false, true} {
			w := wireWalk(shape, strides, base)
			if local {
				w = newWalk(shape, strides, base)
			}
			got := visited(&w)
			if int64(len(got)) != total || w.runs()*w.run != total {
				t.Fatalf("local %v shape %v strides %v: visited %d elements (runs %d x %d), want %d", local, shape, strides, len(got), w.runs(), w.run, total)
			}
			if local {
				sortOffsets(got)
				sortOffsets(want)
			}
			for i := range got {
				if !slices.Equal(got[i], want[i]) {
					t.Fatalf("local %v shape %v strides %v: element %d at %v, want %v", local, shape, strides, i, got[i], want[i])
				}
			}
			if k == 1 && total > 0 {
				segs := w.segments(4, 0)
				var n int64
				for _, s := range segs {
					n += s.Len
				}
				if n != total*4 {
					t.Fatalf("segments cover %d bytes, want %d", n, total*4)
				}
			}
		}
	}
}

// visited lists the element offsets, per operand, that a walk visits.
func visited(w *walk) [][]int64 {
	var got [][]int64
	w.each(func(off []int64) {
		for e := int64(0); e < w.run; e++ {
			o := make([]int64, len(off))
			for j := range o {
				o[j] = off[j] + e // runs are contiguous in every operand
			}
			got = append(got, o)
		}
	})
	return got
}

func sortOffsets(o [][]int64) { slices.SortFunc(o, slices.Compare[[]int64]) }

// A local walk follows memory order: a channels-last copy is one run, and a
// channels-last slab along H is W runs of C elements.
func TestLocalWalkFollowsMemory(t *testing.T) {
	shape := []int64{2, 8, 5, 6} // N, C, H, W
	cl := []int64{5 * 6 * 8, 1, 6 * 8, 8}
	if w := newWalk(shape, [][]int64{cl, cl}, []int64{0, 0}); w.runs() != 1 || w.run != 2*8*5*6 {
		t.Fatalf("channels-last copy: %d runs of %d, want 1 of %d", w.runs(), w.run, 2*8*5*6)
	}
	if w := wireWalk(shape, [][]int64{cl, cl}, []int64{0, 0}); w.run != 1 {
		t.Fatalf("channels-last wire walk: runs of %d, want 1 (logical order)", w.run)
	}
	box := []int64{1, 8, 1, 6}
	if w := newWalk(box, [][]int64{cl}, []int64{0}); w.runs() != 1 || w.run != 48 {
		t.Fatalf("channels-last H slab: %d runs of %d, want 1 of 48", w.runs(), w.run)
	}
	box = []int64{1, 8, 5, 1} // a W slab: H runs of C
	if w := newWalk(box, [][]int64{cl}, []int64{0}); w.runs() != 5 || w.run != 8 {
		t.Fatalf("channels-last W slab: %d runs of %d, want 5 of 8", w.runs(), w.run)
	}
}

func TestWalkCoalesces(t *testing.T) {
	// A slab of a contiguous 5-d tensor along dim 2 is one run per outer index.
	shape := []int64{2, 3, 4, 5, 6}
	st := ContiguousStrides(shape)
	box := []int64{2, 3, 1, 5, 6}
	w := newWalk(box, [][]int64{st}, []int64{2 * st[2]})
	if w.runs() != 6 || w.run != 30 {
		t.Fatalf("runs %d of %d, want 6 of 30", w.runs(), w.run)
	}
	// Along dim 0 a slab is a single run.
	box = []int64{1, 3, 4, 5, 6}
	if w := newWalk(box, [][]int64{st}, []int64{st[0]}); w.runs() != 1 || w.run != 360 {
		t.Fatalf("runs %d of %d, want 1 of 360", w.runs(), w.run)
	}
}

func TestCheckStrides(t *testing.T) {
	ok := [][2][]int64{
		{{2, 3}, {3, 1}}, {{2, 3}, {1, 2}}, {{2, 3}, {4, 1}}, {{1, 3}, {0, 1}}, {{2, 0}, {0, 0}},
	}
	for _, c := range ok {
		if err := checkStrides(c[0], c[1], 4, true); err != nil {
			t.Errorf("%v %v: %v", c[0], c[1], err)
		}
	}
	bad := [][2][]int64{{{2, 3}, {2, 1}}, {{2, 3}, {0, 1}}, {{2, 3}, {1, 1}}}
	for _, c := range bad {
		if err := checkStrides(c[0], c[1], 4, true); err == nil {
			t.Errorf("%v %v: overlap not detected", c[0], c[1])
		}
	}
	if _, err := extent([]int64{1 << 62, 4}, []int64{4, 1}, 4); err == nil {
		t.Error("overflow not detected")
	}
}

// Every halo slot of every rank is filled by exactly its owner (or is
// padding), and what each rank sends is what the others expect.
func TestPartitionAgainstBruteForce(t *testing.T) {
	rng := rand.New(rand.NewSource(4))
	for it := 0; it < 3000; it++ {
		W := 1 + rng.Intn(7)
		lengths := make([]int64, W)
		for r := range lengths {
			lengths[r] = int64(rng.Intn(6))
		}
		L, R := int64(rng.Intn(12)), int64(rng.Intn(12))
		p := newPartition(lengths)
		owner := func(P int64) int {
			for q := 0; q < W; q++ {
				if P >= p.off[q] && P < p.off[q]+lengths[q] {
					return q
				}
			}
			return -1
		}
		sent := map[message]int{}
		for r := 0; r < W; r++ {
			for _, m := range p.outgoing(r, L, R) {
				sent[m]++
			}
		}
		for s := 0; s < W; s++ {
			from := map[int64]int{}
			for _, m := range p.incoming(s, L, R) {
				if m.dst != s || m.src == s || sent[m] != 1 {
					t.Fatalf("lengths %v L %d R %d: message %+v not sent exactly once", lengths, L, R, m)
				}
				delete(sent, m)
				for P := m.lo; P < m.hi; P++ {
					from[P] = m.src
				}
			}
			padL, padR := p.padding(s, L, R)
			var gotPadL, gotPadR int64
			for P := p.off[s] - L; P < p.off[s]+lengths[s]+R; P++ {
				if P >= p.off[s] && P < p.off[s]+lengths[s] {
					continue
				}
				q, ok := from[P]
				switch o := owner(P); {
				case o < 0 && ok:
					t.Fatalf("padding slot %d of rank %d received from %d", P, s, q)
				case o < 0 && P < 0:
					gotPadL++
				case o < 0:
					gotPadR++
				case !ok || q != o:
					t.Fatalf("lengths %v L %d R %d: rank %d slot %d from %d (ok %v), owner %d", lengths, L, R, s, P, q, ok, o)
				}
			}
			if gotPadL != padL || gotPadR != padR {
				t.Fatalf("lengths %v L %d R %d rank %d: padding %d,%d want %d,%d", lengths, L, R, s, padL, padR, gotPadL, gotPadR)
			}
		}
		if len(sent) != 0 {
			t.Fatalf("lengths %v L %d R %d: sent but never received: %v", lengths, L, R, sent)
		}
	}
}

func TestFloat16Conversions(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		f := F16ToF32(uint16(h))
		if f != f {
			if got := F32ToF16(f); got != uint16(h)&0x8000|0x7e00 {
				t.Fatalf("NaN %#x -> %#x", h, got)
			}
			continue
		}
		if got := F32ToF16(f); got != uint16(h) {
			t.Fatalf("round trip %#x -> %v -> %#x", h, f, got)
		}
	}
	// Rounding against float64 arithmetic: nearest, ties to even.
	rng := rand.New(rand.NewSource(5))
	for i := 0; i < 200000; i++ {
		f := math.Float32frombits(rng.Uint32())
		if f != f || math.Abs(float64(f)) > 65520 {
			continue
		}
		h := F32ToF16(f)
		best, bestErr := uint16(0), math.Inf(1)
		for _, c := range []uint16{h - 1, h, h + 1} {
			v := float64(F16ToF32(c))
			if e := math.Abs(v - float64(f)); e < bestErr || (e == bestErr && c&1 == 0) {
				best, bestErr = c, e
			}
		}
		if best != h && !(h&0x7fff == 0 && best&0x7fff == 0) {
			t.Fatalf("%v -> %#x, nearest-even is %#x", f, h, best)
		}
	}
	if F32ToF16(65520) != 0x7c00 || F32ToF16(65519) != 0x7bff {
		t.Fatal("overflow threshold")
	}
}

func TestBFloat16Conversions(t *testing.T) {
	cases := map[uint32]uint16{
		0x3f800000: 0x3f80, 0x3f808000: 0x3f80, 0x3f818000: 0x3f82, 0x3f808001: 0x3f81,
		0x7f7fffff: 0x7f80, 0x80000000: 0x8000, 0x7fc00001: 0x7fc0, 0xffc00000: 0x7fc0,
	}
	for in, want := range cases {
		if got := F32ToBF16(math.Float32frombits(in)); got != want {
			t.Errorf("%#x -> %#x, want %#x", in, got, want)
		}
	}
}

// addZero's shortcut must equal adding +0 for every bit pattern class.
func TestAddZeroMatchesArithmetic(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	f32 := []uint32{0, 0x80000000, 0x7f800000, 0xff800000, 0x7f800001, 0xff800001, 0x7fc00000, 0x7fa00000, 0x3f800000, 1, 0x80000001}
	for i := 0; i < 10000; i++ {
		f32 = append(f32, rng.Uint32())
	}
	for _, v := range f32 {
		a := []uint32{v}
		addZero(Float32, unsafe.Pointer(&a[0]), 1)
		if want := math.Float32bits(math.Float32frombits(v) + 0); a[0] != want {
			t.Fatalf("float32 %#x: %#x, want %#x", v, a[0], want)
		}
		d := uint64(v)<<32 | uint64(rng.Uint32())
		for _, w := range []uint64{d, 1 << 63, 0x7ff0000000000001, 0x7ff8000000000000, 0xfff0000000000000} {
			b := []uint64{w}
			addZero(Float64, unsafe.Pointer(&b[0]), 1)
			if want := math.Float64bits(math.Float64frombits(w) + 0); b[0] != want {
				t.Fatalf("float64 %#x: %#x, want %#x", w, b[0], want)
			}
		}
	}
	for h := 0; h < 1<<16; h++ {
		a := []uint16{uint16(h), uint16(h)}
		addZero(Float16, unsafe.Pointer(&a[0]), 1)
		addZero(BFloat16, unsafe.Pointer(&a[1]), 1)
		if want := F32ToF16(f16ToF32Slow(uint16(h)) + 0); a[0] != want {
			t.Fatalf("float16 %#x: %#x, want %#x", h, a[0], want)
		}
		if want := F32ToBF16(BF16ToF32(uint16(h)) + 0); a[1] != want {
			t.Fatalf("bfloat16 %#x: %#x, want %#x", h, a[1], want)
		}
	}
}
