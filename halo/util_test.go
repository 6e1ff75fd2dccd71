package halo

import "unsafe"

// Test helpers in this package with exported names (here and in
// oracle_test.go) are shared with the external tests (package halo_test),
// which run ranks over halotest's in-memory transport and so cannot live in
// this package: halotest imports halo.

func PtrOf[T any](s []T) unsafe.Pointer { return unsafe.Pointer(unsafe.SliceData(s)) }

// Normalized is the spec with every default filled in, as a plan keeps it.
func (s Spec) Normalized() Spec { return s.normalized() }
