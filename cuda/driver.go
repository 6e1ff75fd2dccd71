// Package cuda is the CUDA side of stream-ordered exchanges: the driver
// calls they need, loaded at run time (libhalo links no CUDA library), a host
// emulation of those calls for machines with no GPU, and the proxy that runs
// exchanges in stream order.
package cuda

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Stream is a CUstream (a cudaStream_t is the same pointer). 0 is not a
// stream here: the C API's NULL means "no stream"; CUDA's legacy default
// stream is LegacyStream.
type Stream uintptr

// LegacyStream is CU_STREAM_LEGACY, the handle of CUDA's default stream.
const LegacyStream Stream = 1

// Event is a CUevent, or the emulation's event.
type Event uintptr

// Flag is a 32-bit word that the host writes and a stream waits on.
type Flag struct {
	host unsafe.Pointer // what the proxy writes
	dev  uint64         // the same word, as the device sees it
}

// Set stores v where the stream reads it.
func (f *Flag) Set(v uint32) { atomic.StoreUint32((*uint32)(f.host), v) }

// Get reads the flag from the host.
func (f *Flag) Get() uint32 { return atomic.LoadUint32((*uint32)(f.host)) }

// Driver is the part of the CUDA driver API that the proxy uses.
type Driver interface {
	Name() string
	CurrentContext() (uintptr, error)
	SetContext(ctx uintptr) error
	EventCreate() (Event, error)
	EventRecord(ev Event, s Stream) error
	// EventQuery reports whether the work before the event's record has run.
	EventQuery(ev Event) (bool, error)
	EventDestroy(ev Event) error
	FlagAlloc() (*Flag, error)
	FlagFree(f *Flag) error
	// StreamWaitFlag makes later work on s wait until the flag is >= v.
	StreamWaitFlag(s Stream, f *Flag, v uint32) error
}

var loaded struct {
	once sync.Once
	drv  Driver
	err  error
}

// Load returns the driver of this process, loading it on first use: kind
// "cuda" (or "") is libcuda.so.1, "host-fake" the host emulation; the first
// call's kind holds for the process (HALO_CUDA_DRIVER, comm.Settings).
func Load(kind string) (Driver, error) {
	loaded.once.Do(func() {
		switch kind {
		case "", "cuda":
			loaded.drv, loaded.err = loadLibcuda()
		case "host-fake":
			loaded.drv = NewHostFake()
		default:
			loaded.err = fmt.Errorf("CUDA driver %q is neither cuda (the default) nor host-fake", kind)
		}
	})
	return loaded.drv, loaded.err
}
