package halo

import "unsafe"

//go:noescape
func addBF16x8(dst, src *uint16, n int)

//go:noescape
func addF32x4(dst, src *float32, n int)

// addBF16Vector adds the leading multiple of 8 elements with SSE2 and says
// how many it did.
func addBF16Vector(a, b []uint16) int {
	n := len(a) &^ 7
	if n > 0 {
		addBF16x8(&a[0], &b[0], n)
	}
	return n
}

func addF32Vector(a, b []float32) int {
	n := len(a) &^ 3
	if n > 0 {
		addF32x4(&a[0], &b[0], n)
	}
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
