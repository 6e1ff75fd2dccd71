package ucx

/*
#include "helpers.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"time"
)

// Transport is one rank's UCP context and worker, with an endpoint to every
// other rank of its group once connected.
type Transport struct {
	mu          sync.Mutex
	abortMu     sync.Mutex         // see Abort
	c           *C.hux_transport_t // nil once closed
	rank        int
	size        int
	rankBits    int
	peerMode    bool
	sleepAfter  time.Duration // < 0: the worker has no wakeup support
	connected   bool
	addr        []byte
	batches     map[*Batch]struct{} // open batches, closed with the transport
	memoryTypes uint64              // bit set of ucs_memory_type_t (ucp_context_query)
}

// Rank is this transport's rank in its group.
func (t *Transport) Rank() int { return t.rank }

// Size is the number of ranks in the group.
func (t *Transport) Size() int { return t.size }

// TagBits is how many low bits of Op.Tag are the caller's: the bits above
// carry the sender's rank on the wire (64 - ceil(log2(Size))).
func (t *Transport) TagBits() int { return 64 - t.rankBits }

// Abort makes every Wait on the transport, running or future, end within
// microseconds with ErrAborted (after the same cleanup as a deadline), and
// every later Post fail with it. Unlike the other methods it may be called
// from any goroutine at any time, also while another one waits (which holds
// mu): it takes only abortMu. The transport can then only be closed.
func (t *Transport) Abort() {
	t.abortMu.Lock()
	defer t.abortMu.Unlock()
	if t.c != nil {
		C.hux_transport_abort(t.c)
	}
}

// PeerGone says that peer's process has ended: its waits and posts fail
// with a *PeerError (StatusPeerGone) within a look at the clock, after what
// it had sent has been read; the endpoint is force-closed. Like Abort, safe
// from any goroutine at any time.
func (t *Transport) PeerGone(peer int) {
	t.abortMu.Lock()
	defer t.abortMu.Unlock()
	if t.c != nil {
		C.hux_peer_gone(t.c, C.int(peer))
	}
}

// AbortFor is Abort because peer died (its operations failed on it): the
// goodbye this rank then sends says so, and the peers' errors name both.
func (t *Transport) AbortFor(peer int) {
	t.abortMu.Lock()
	if t.c != nil && t.c.abort_cause < 0 {
		t.c.abort_cause = C.int32_t(peer)
	}
	t.abortMu.Unlock()
	t.Abort()
}

// Aborted reports whether Abort was called.
func (t *Transport) Aborted() bool {
	t.abortMu.Lock()
	defer t.abortMu.Unlock()
	return t.c == nil || C.hux_transport_aborted(t.c) != 0
}

// Close releases every batch, force-closes every endpoint (without waiting
// for peers, so a dead peer cannot make it hang) and destroys the worker and
// the context. A Wait running on another goroutine finishes first. Buffers
// from Alloc stay valid until freed. Everything is released even when Close
// returns an error, which only reports endpoints UCX was slow to close. Close
// is safe to call more than once; later calls return nil.
func (t *Transport) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c == nil {
		return nil
	}
	for b := range t.batches {
		b.destroy()
	}
	slow := t.closeEndpoints()
	t.abortMu.Lock()
	c := t.c
	t.c = nil // written under both locks, read under either
	t.abortMu.Unlock()
	C.hux_transport_destroy(c)
	if len(slow) > 0 {
		return fmt.Errorf("ucx: close: endpoints to ranks %v did not close within %v (released with the worker)", slow, abortGrace)
	}
	return nil
}
