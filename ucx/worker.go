package ucx

/*
#include <stdlib.h>
#include "helpers.h"
*/
import "C"

import "unsafe"

// initWorker creates the transport's worker and keeps a copy of its address.
func (t *Transport) initWorker() error {
	if st := C.hux_worker_create(t.c, cbool(t.sleepAfter >= 0)); st != C.UCS_OK {
		t.c.worker = nil
		return statusError("ucp_worker_create", st)
	}
	var addr unsafe.Pointer
	var n C.size_t
	if st := C.hux_worker_address(t.c.worker, &addr, &n); st != C.UCS_OK {
		return statusError("ucp_worker_get_address", st)
	}
	t.addr = C.GoBytes(addr, C.int(n))
	C.free(addr)
	return nil
}

// Address returns this worker's address, to be given to every peer's
// Connect. The slice is shared; do not modify it.
func (t *Transport) Address() []byte {
	return t.addr
}

// Sleeps reports whether a long idle Wait sleeps on the worker's event fd
// (else it keeps yielding the CPU between polls).
func (t *Transport) Sleeps() bool { return t.c != nil && t.c.efd >= 0 }

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}
