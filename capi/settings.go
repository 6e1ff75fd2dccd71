package main

/*
#include <stdint.h>
*/
import "C"

import (
	"time"

	"github.com/halo-cp/halo/comm"
)

//export haloGoSettingMS
func haloGoSettingMS(name *C.char, ms *C.int64_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		if name == nil || ms == nil {
			return invalid("name or ms (the output pointer) is NULL")
		}
		d, err := comm.DurationSetting(C.GoString(name))
		if err != nil {
			return err
		}
		*ms = C.int64_t(d / time.Millisecond)
		return nil
	})
}
