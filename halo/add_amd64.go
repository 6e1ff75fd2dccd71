package halo

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
