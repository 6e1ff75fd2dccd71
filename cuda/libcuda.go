package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// libcuda is the Driver of libcuda.so.1, bound by driver.c. Contexts, events
// and streams stay numbers (C.uintptr_t) all the way to the driver: they are
// handles, not memory, and a small one in a Go pointer type aborts the
// process when the collector finds it.
type libcuda struct{}

func loadLibcuda() (Driver, error) {
	var why [512]C.char
	if C.halo_cu_load(&why[0], C.size_t(len(why))) != 0 {
		return nil, fmt.Errorf("%s", C.GoString(&why[0]))
	}
	return libcuda{}, nil
}

func check(rc C.int, call string) error {
	if rc == 0 {
		return nil
	}
	var msg [256]C.char
	C.halo_cu_error(rc, &msg[0], C.size_t(len(msg)))
	return fmt.Errorf("%s: %s", call, C.GoString(&msg[0]))
}

func (libcuda) Name() string { return "libcuda.so.1" }

func (libcuda) CurrentContext() (uintptr, error) {
	var ctx C.uintptr_t
	if err := check(C.halo_cu_ctx_get_current(&ctx), "cuCtxGetCurrent"); err != nil {
		return 0, err
	}
	if ctx == 0 {
		return 0, fmt.Errorf("no CUDA context is current on the calling thread (make the tensor's device current first)")
	}
	return uintptr(ctx), nil
}

func (libcuda) SetContext(ctx uintptr) error {
	return check(C.halo_cu_ctx_set_current(C.uintptr_t(ctx)), "cuCtxSetCurrent")
}

func (libcuda) EventCreate() (Event, error) {
	var ev C.uintptr_t
	err := check(C.halo_cu_event_create(&ev), "cuEventCreate")
	return Event(ev), err
}

func (libcuda) EventRecord(ev Event, s Stream) error {
	return check(C.halo_cu_event_record(C.uintptr_t(ev), C.uintptr_t(s)), "cuEventRecord")
}

// cudaErrorNotReady's driver twin: the event's work has not run yet.
const cudaErrorNotReady = 600

func (libcuda) EventQuery(ev Event) (bool, error) {
	rc := C.halo_cu_event_query(C.uintptr_t(ev))
	if rc == cudaErrorNotReady {
		return false, nil
	}
	return rc == 0, check(rc, "cuEventQuery")
}

func (libcuda) EventDestroy(ev Event) error {
	return check(C.halo_cu_event_destroy(C.uintptr_t(ev)), "cuEventDestroy")
}

func (libcuda) FlagAlloc() (*Flag, error) {
	var host unsafe.Pointer
	var dev C.uint64_t
	if err := check(C.halo_cu_flag_alloc(&host, &dev), "cuMemHostAlloc"); err != nil {
		return nil, err
	}
	return &Flag{host: host, dev: uint64(dev)}, nil
}

func (libcuda) FlagFree(f *Flag) error { return check(C.halo_cu_flag_free(f.host), "cuMemFreeHost") }

func (libcuda) StreamWaitFlag(s Stream, f *Flag, v uint32) error {
	return check(C.halo_cu_stream_wait_value32(C.uintptr_t(s), C.uint64_t(f.dev), C.uint32_t(v)), "cuStreamWaitValue32")
}
