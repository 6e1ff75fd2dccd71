package main

/*
#include "halo.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/halo-cp/halo/halo"
)

// errHandle is the C ABI's own failure: a handle that is NULL, destroyed or
// of the wrong kind. Every other error is classed by halo.
var errHandle = errors.New("invalid handle")

// code maps an error to the result code of include/halo.h: one code per
// halo error class. An error of no class is a bug, reported as such.
func code(err error) C.int {
	switch {
	case err == nil:
		return C.HALO_SUCCESS
	case errors.Is(err, errHandle):
		return C.HALO_ERR_INVALID_HANDLE
	case errors.Is(err, halo.ErrInternal):
		return C.HALO_ERR_INTERNAL
	case errors.Is(err, halo.ErrInvalid):
		return C.HALO_ERR_INVALID_ARGUMENT
	case errors.Is(err, halo.ErrMismatch):
		return C.HALO_ERR_MISMATCH
	case errors.Is(err, halo.ErrFailed):
		return C.HALO_ERR_COMM_FAILED
	case errors.Is(err, halo.ErrState), errors.Is(err, halo.ErrClosed):
		return C.HALO_ERR_INVALID_STATE
	case errors.Is(err, halo.ErrRendezvous):
		return C.HALO_ERR_RENDEZVOUS
	case errors.Is(err, halo.ErrTimeout):
		return C.HALO_ERR_TIMEOUT
	case errors.Is(err, halo.ErrPeerFailed):
		return C.HALO_ERR_PEER_FAILED
	case errors.Is(err, halo.ErrTransport):
		return C.HALO_ERR_TRANSPORT
	}
	return C.HALO_ERR_INTERNAL
}

func finish(rc *C.int, panicked any, err error, buf *C.char, n C.size_t) {
	if panicked != nil {
		err = fmt.Errorf("%w: panic: %v", halo.ErrInternal, panicked)
	}
	*rc = code(err)
	if err == nil || buf == nil || n == 0 {
		return
	}
	msg := err.Error()
	b := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
	k := copy(b[:n-1], msg)
	b[k] = 0
}
