package halo

import (
	"unsafe"

	cpuid "golang.org/x/sys/cpu"
)

//go:noescape
func addBF16x8(dst, src *uint16, n int)

//go:noescape
func addBF16x16(dst, src *uint16, n int)

//go:noescape
func addF16x16(dst, src *uint16, n int)

//go:noescape
func addF32x4(dst, src *float32, n int)

//go:noescape
func addF32x32(dst, src *float32, n int)

//go:noescape
func addF64x16(dst, src *float64, n int)

// kernels says which kernels this CPU runs, chosen once at start (SSE2 is
// part of every amd64 CPU); tests turn them off to check the code the other
// CPUs run.
var kernels = struct{ sse2, avx, avx2, f16c bool }{
	sse2: true,
	avx:  cpuid.X86.HasAVX,
	avx2: cpuid.X86.HasAVX2,
	f16c: cpuid.X86.HasAVX && cpuid.X86.HasF16C,
}

// addBF16Vector adds the leading multiple of 16 (AVX2) or 8 (SSE2) elements
// and says how many it did.
func addBF16Vector(a, b []uint16) int {
	if kernels.avx2 {
		n := len(a) &^ 15
		if n > 0 {
			addBF16x16(&a[0], &b[0], n)
		}
		return n
	}
	n := len(a) &^ 7
	if !kernels.sse2 {
		return 0
	}
	if n > 0 {
		addBF16x8(&a[0], &b[0], n)
	}
	return n
}

// addF16Vector adds the leading multiple of 16 elements with F16C, if the
// CPU has it, and says how many it did.
func addF16Vector(a, b []uint16) int {
	n := len(a) &^ 15
	if !kernels.f16c || n == 0 {
		return 0
	}
	addF16x16(&a[0], &b[0], n)
	return n
}

// addF32Vector adds the leading multiple of 32 (AVX) or 4 (SSE2) elements
// and says how many it did.
func addF32Vector(a, b []float32) int {
	if n := len(a) &^ 31; kernels.avx && n > 0 {
		addF32x32(&a[0], &b[0], n)
		return n + addF32Vector(a[n:], b[n:])
	}
	n := len(a) &^ 3
	if kernels.sse2 && n > 0 {
		addF32x4(&a[0], &b[0], n)
		return n
	}
	return 0
}

// addF64Vector adds the leading multiple of 16 elements with AVX, if the
// CPU has it, and says how many it did.
func addF64Vector(a, b []float64) int {
	n := len(a) &^ 15
	if !kernels.avx || n == 0 {
		return 0
	}
	addF64x16(&a[0], &b[0], n)
	return n
}

//go:noescape
func copyNT(dst, src *byte, n int)

// copyLarge copies like copy, with non-temporal stores for the aligned bulk.
func copyLarge(dst, src []byte) {
	head := int((16 - uintptr(unsafe.Pointer(unsafe.SliceData(dst)))%16) % 16)
	head = min(head, len(dst))
	copy(dst[:head], src[:head])
	bulk := (len(dst) - head) &^ 63
	if bulk > 0 {
		copyNT(&dst[head], &src[head], bulk)
	}
	copy(dst[head+bulk:], src[head+bulk:])
}
