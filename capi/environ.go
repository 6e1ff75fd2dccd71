package main

/*
#include <stdlib.h>
*/
import "C"

import (
	"unsafe"

	"github.com/halo-cp/halo/comm"
)

// Settings are read through the C library's getenv: Go's own copy of the
// environment is taken when the library is loaded, and the process (Python's
// os.environ, a C++ trainer's setenv) may set HALO_* variables after that,
// before it makes a communicator.
func init() { comm.Getenv = getenv }

func getenv(name string) string {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	v := C.getenv(cname)
	if v == nil {
		return ""
	}
	return C.GoString(v)
}
