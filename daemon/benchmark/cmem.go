package benchmark

import (
	"fmt"
	"unsafe"

	"github.com/halo-cp/halo/ucx"
)

// cbuf is C memory. Tensors passed to a plan's exchanges must not live on
// the Go heap: UCX holds on to them during the call, and the Go collector
// may move or free what it does not know is in use.
type cbuf struct {
	b *ucx.Buffer
	p unsafe.Pointer
}

func allocC(n int64) (*cbuf, error) {
	b, err := ucx.AllocBuffer(int(n))
	if err != nil {
		return nil, fmt.Errorf("cannot allocate %s for a tensor: %w", fmtBytes(n), err)
	}
	return &cbuf{b: b, p: b.Ptr()}, nil
}

func (b *cbuf) free() {
	if b != nil {
		b.b.Free()
		b.p = nil
	}
}

func (b *cbuf) at(off int64) unsafe.Pointer { return unsafe.Add(b.p, off) }
