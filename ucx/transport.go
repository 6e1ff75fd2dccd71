package ucx

/*
#include "helpers.h"
*/
import "C"

import (
	"fmt"
	"sync"
)

// Transport is one rank's UCP context and worker, with an endpoint to every
// other rank of its group once connected.
type Transport struct {
	mu        sync.Mutex
	c         *C.hux_transport_t // nil once closed
	rank      int
	size      int
	rankBits  int
	peerMode  bool
	connected bool
	addr      []byte
	batches   map[*Batch]struct{} // open batches, closed with the transport
}

// Rank is this transport's rank in its group.
func (t *Transport) Rank() int { return t.rank }

// Size is the number of ranks in the group.
func (t *Transport) Size() int { return t.size }

// TagBits is how many low bits of Op.Tag are the caller's: the bits above
// carry the sender's rank on the wire (64 - ceil(log2(Size))).
func (t *Transport) TagBits() int { return 64 - t.rankBits }

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
	C.hux_transport_destroy(t.c)
	t.c = nil
	if len(slow) > 0 {
		return fmt.Errorf("ucx: close: endpoints to ranks %v did not close within %v (released with the worker)", slow, abortGrace)
	}
	return nil
}
