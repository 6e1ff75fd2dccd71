package main

/*
#include "halo.h"
#include "calls.h"
*/
import "C"

import (
	"fmt"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/halo"
)

// abiMismatches lists the constants of include/halo.h whose Go copies differ
// from the header. The Go packages cannot include the header (halo and comm
// are pure Go), so capi, which sees both, is where they are compared; result
// codes and field-mask bits have no Go copies (capi uses C.HALO_* directly).
func abiMismatches() []string {
	ints := []struct {
		name         string
		header, inGo int64
	}{
		{"HALO_FLOAT32", C.HALO_FLOAT32, int64(halo.Float32)},
		{"HALO_FLOAT64", C.HALO_FLOAT64, int64(halo.Float64)},
		{"HALO_FLOAT16", C.HALO_FLOAT16, int64(halo.Float16)},
		{"HALO_BFLOAT16", C.HALO_BFLOAT16, int64(halo.BFloat16)},
		{"HALO_PAD_ZEROS", C.HALO_PAD_ZEROS, int64(halo.PadZeros)},
		{"HALO_PAD_REPLICATE", C.HALO_PAD_REPLICATE, int64(halo.PadReplicate)},
		{"HALO_PAD_REFLECT", C.HALO_PAD_REFLECT, int64(halo.PadReflect)},
		{"HALO_PAD_CIRCULAR", C.HALO_PAD_CIRCULAR, int64(halo.PadCircular)},
		{"HALO_MEMORY_HOST", C.HALO_MEMORY_HOST, int64(halo.MemoryHost)},
		{"HALO_MEMORY_CUDA", C.HALO_MEMORY_CUDA, int64(halo.MemoryCUDA)},
		{"HALO_BOOTSTRAP_RENDEZVOUS", C.HALO_BOOTSTRAP_RENDEZVOUS, int64(comm.BootstrapRendezvous)},
		{"HALO_BOOTSTRAP_EXTERNAL", C.HALO_BOOTSTRAP_EXTERNAL, int64(comm.BootstrapExternal)},
		{"HALO_DIR_FORWARD", C.HALO_DIR_FORWARD, int64(halo.DirForward)},
		{"HALO_DIR_BACKWARD", C.HALO_DIR_BACKWARD, int64(halo.DirBackward)},
		{"HALO_CALL_FORWARD (capi/calls.h)", C.HALO_CALL_FORWARD, int64(halo.CallForward)},
		{"HALO_CALL_BACKWARD (capi/calls.h)", C.HALO_CALL_BACKWARD, int64(halo.CallBackward)},
		{"HALO_CALL_HALOS_FORWARD (capi/calls.h)", C.HALO_CALL_HALOS_FORWARD, int64(halo.CallHalosForward)},
		{"HALO_CALL_HALOS_BACKWARD (capi/calls.h)", C.HALO_CALL_HALOS_BACKWARD, int64(halo.CallHalosBackward)},
	}
	var bad []string
	for _, k := range ints {
		if k.header != k.inGo {
			bad = append(bad, fmt.Sprintf("%s is %d in include/halo.h but %d in Go", k.name, k.header, k.inGo))
		}
	}
	if C.HALO_VERSION_STRING != halo.Version {
		bad = append(bad, fmt.Sprintf("HALO_VERSION_STRING is %q in include/halo.h but halo.Version is %q", C.HALO_VERSION_STRING, halo.Version))
	}
	return bad
}
