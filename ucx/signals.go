package ucx

/*
#include "helpers.h"
*/
import "C"

// signalReclaim lets a test switch reclaimSignals off to show what it
// prevents.
var signalReclaim = true

// reclaimSignals gives SIGSEGV, SIGBUS and SIGFPE back to the Go runtime
// where libucs's error handler holds them (see the package documentation).
// It returns how many handlers it replaced, or -1 if the Go runtime's handler
// could not be identified (then nothing was changed).
func reclaimSignals() int {
	if !signalReclaim {
		return 0
	}
	return int(C.hux_reclaim_signals())
}
