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
