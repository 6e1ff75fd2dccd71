package halo

import (
	"testing"
	"unsafe"
)

// Kernel throughput, for choosing implementations (bench/RESULTS.md).
func benchAdd(b *testing.B, d DType) {
	n := (2 << 20) / d.Size()
	dst, src := make([]byte, 2<<20), make([]byte, 2<<20)
	b.SetBytes(2 << 20)
	for i := 0; i < b.N; i++ {
		addInto(d, unsafe.Pointer(&dst[0]), unsafe.Pointer(&src[0]), n)
	}
}

func BenchmarkAdd2MiBFloat32(b *testing.B)  { benchKernels(b, Float32) }
func BenchmarkAdd2MiBFloat64(b *testing.B)  { benchKernels(b, Float64) }
func BenchmarkAdd2MiBFloat16(b *testing.B)  { benchKernels(b, Float16) }
func BenchmarkAdd2MiBBFloat16(b *testing.B) { benchKernels(b, BFloat16) }

// benchKernels times the additions with each kernel set a CPU may have:
// the fastest this one has, SSE2 only, and none.
func benchKernels(b *testing.B, d DType) {
	b.Run("best", func(b *testing.B) { benchAdd(b, d) })
	b.Run("sse2", func(b *testing.B) { withKernels(true, false, false, func() { benchAdd(b, d) }) })
	b.Run("scalar", func(b *testing.B) { withKernels(false, false, false, func() { benchAdd(b, d) }) })
}

func BenchmarkAddZero2MiBFloat32(b *testing.B) {
	dst := make([]byte, 2<<20)
	b.SetBytes(2 << 20)
	for i := 0; i < b.N; i++ {
		addZero(Float32, unsafe.Pointer(&dst[0]), len(dst)/4)
	}
}

func BenchmarkCopy2MiB(b *testing.B) {
	dst, src := make([]byte, 2<<20), make([]byte, 2<<20)
	b.SetBytes(2 << 20)
	for i := 0; i < b.N; i++ {
		copy(dst, src)
	}
}
