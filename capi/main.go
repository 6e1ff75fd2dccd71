// Package main is libhalo.so: the C ABI of include/halo.h over comm/ and
// halo/. Exports live in exports.go, handles in handles.go, result codes in
// results.go; the public C names are the wrappers in halo.c.
package main

func main() {}
