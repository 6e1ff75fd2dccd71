package ucx

/*
#include "helpers.h"
*/
import "C"

// AbortedPeer reports a peer of the batch, which has just completed, that
// has aborted (its goodbye has arrived): what the batch matched from it
// belongs to an exchange it abandoned, or went to a rank that is gone, so
// the batch must not count as a success. A peer's goodbye comes after what
// it sent before, so it may still wait on the wire, unread, behind the
// messages the batch completed on: AbortedPeer reads the wire first (one
// cgo call and an idle poll of the worker, about 0.1 µs).
func (b *Batch) AbortedPeer() (rank int, aborted bool) {
	t := b.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c == nil {
		return 0, false
	}
	C.hux_worker_poll(t.c)
	for _, info := range b.info {
		if Status(t.peer(info.peer).err) == StatusPeerAborted {
			return info.peer, true
		}
	}
	return 0, false
}

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
