//go:build !amd64

package halo

// kernels: no vector kernels off amd64 (the tests that turn them off still
// compile).
var kernels struct{ sse2, avx, avx2, f16c bool }

func addBF16Vector(a, b []uint16) int { return 0 }
func addF16Vector(a, b []uint16) int  { return 0 }
func addF32Vector(a, b []float32) int { return 0 }
func addF64Vector(a, b []float64) int { return 0 }

func copyLarge(dst, src []byte) { copy(dst, src) }
