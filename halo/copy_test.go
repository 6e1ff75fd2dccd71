package halo

import (
	"bytes"
	"math/rand"
	"testing"
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

// A forward whose interior copy is large enough to bypass the cache still
// copies every byte to the right place.
func TestLargeInteriorCopy(t *testing.T) {
	hub := NewMemHub(1)
	g, _ := NewGroup(hub.Transport(0), GroupOptions{})
	const rows, cols = 3, 1<<19 + 3 // 6 MiB of float32, odd row length
	p, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{rows, cols}, Dim: 1, Left: 1, Right: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	x := make([]float32, rows*cols)
	for i := range x {
		x[i] = float32(i)
	}
	out := make([]float32, rows*(cols+3))
	if err := p.Forward(ptrOf(x), ptrOf(out)); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < rows; r++ {
		row := out[r*(cols+3) : (r+1)*(cols+3)]
		if row[0] != 0 || row[cols+1] != 0 || row[cols+2] != 0 {
			t.Fatalf("row %d: padding not zero", r)
		}
		for c := 0; c < cols; c++ {
			if row[1+c] != x[r*cols+c] {
				t.Fatalf("row %d col %d: %v, want %v", r, c, row[1+c], x[r*cols+c])
			}
		}
	}
}
