package ucx

/*
#include <stdlib.h>
#include "helpers.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Buffer is page-aligned, zeroed C memory for messages. It does not depend
// on the transport that allocated it and stays valid until Free.
//
// Plain memory rather than ucp_mem_map: on shared memory and TCP UCX gains
// nothing from registration (see NOTES.md), and unregistered memory need not
// be released before the worker is destroyed.
type Buffer struct {
	p unsafe.Pointer // nil once freed
	n int
}

// Alloc returns n bytes of zeroed C memory.
func (t *Transport) Alloc(n int) (*Buffer, error) { return AllocBuffer(n) }

// AllocBuffer returns n bytes of zeroed, page-aligned C memory that belongs
// to no transport: for tensors that UCX reads and writes during a call,
// which must not live on the Go heap. Every page is touched here, not during
// the first timed call.
func AllocBuffer(n int) (*Buffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("ucx: alloc: negative size %d", n)
	}
	p := C.hux_alloc(C.size_t(n))
	if p == nil {
		return nil, fmt.Errorf("ucx: alloc %d bytes: %w", n, statusError("posix_memalign", C.UCS_ERR_NO_MEMORY))
	}
	return &Buffer{p: p, n: n}, nil
}

// Ptr is the buffer's address as a pointer; nil after Free.
func (b *Buffer) Ptr() unsafe.Pointer { return b.p }

// Addr is the buffer's address, for Batch.Post; 0 after Free.
func (b *Buffer) Addr() uintptr { return uintptr(b.p) }

// Bytes is the buffer as a slice, valid until Free; nil after Free.
func (b *Buffer) Bytes() []byte {
	if b.p == nil {
		return nil
	}
	return unsafe.Slice((*byte)(b.p), b.n)
}

// Free releases the buffer. It is safe to call more than once.
func (b *Buffer) Free() error {
	if b.p != nil {
		C.free(b.p)
		b.p = nil
	}
	return nil
}
