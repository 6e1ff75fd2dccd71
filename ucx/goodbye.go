package ucx

/*
#include "helpers.h"
*/
import "C"

// Goodbye tells every connected peer now that this transport is done (see
// closeEndpoints), rather than when it is closed: after Abort, so that
// peers stop at once even while the caller keeps its communicator. It
// waits for a Wait that the abort is ending; safe to call more than once.
func (t *Transport) Goodbye() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c != nil && t.connected {
		C.hux_say_goodbye(t.c, C.int64_t(abortGrace))
	}
}
