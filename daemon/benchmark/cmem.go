package benchmark

/*
#include <stdlib.h>
#include <string.h>

static void *hb_alloc(size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, 4096, n == 0 ? 1 : n) != 0) {
        return NULL;
    }
    memset(p, 0, n); // touch every page now, not during the first timed call
    return p;
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// cbuf is C memory. Tensors passed to Forward and Backward must not live on
// the Go heap: UCX holds on to them during the call, and the Go collector
// may move or free what it does not know is in use.
type cbuf struct {
	p unsafe.Pointer
	n int64
}

func allocC(n int64) (*cbuf, error) {
	p := C.hb_alloc(C.size_t(n))
	if p == nil {
		return nil, fmt.Errorf("cannot allocate %s for a tensor", fmtBytes(n))
	}
	return &cbuf{p: p, n: n}, nil
}

func (b *cbuf) free() {
	if b != nil && b.p != nil {
		C.free(b.p)
		b.p = nil
	}
}

func (b *cbuf) at(off int64) unsafe.Pointer { return unsafe.Add(b.p, off) }
