package ucx

/*
#include <stdio.h>
#include <stdlib.h>
#include "helpers.h"

static char *hux_ep_info(ucp_ep_h ep, size_t *len)
{
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);

    if (f == NULL) {
        return NULL;
    }
    ucp_ep_print_info(ep, f);
    fclose(f);
    return buf;
}
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// Connect creates an endpoint to every other rank; addrs[i] is the worker
// address of rank i (addrs[Rank()] is ignored). Connecting does not wait for
// the peers: wire-up completes during the first operations.
func (t *Transport) Connect(addrs [][]byte) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c == nil {
		return ErrClosed
	}
	if t.connected {
		return fmt.Errorf("ucx: connect: already connected")
	}
	if len(addrs) != t.size {
		return fmt.Errorf("ucx: connect: %d addresses for a group of %d", len(addrs), t.size)
	}
	for i, a := range addrs {
		if i != t.rank && len(a) == 0 {
			return fmt.Errorf("ucx: connect: no address for rank %d", i)
		}
	}
	peerMode := C.int(0)
	if t.peerMode {
		peerMode = 1
	}
	for i, a := range addrs {
		if i == t.rank {
			continue
		}
		ca := C.CBytes(a)
		var why [256]C.char
		st := C.hux_ep_create(t.c, C.int(i), ca, peerMode, &why[0], C.size_t(len(why)))
		C.free(ca)
		if st != C.UCS_OK {
			t.closeEndpoints()
			return &ConnectError{Rank: i, Status: Status(st), Detail: C.GoString(&why[0])}
		}
	}
	t.connected = true
	return nil
}

// closeEndpoints force-closes every endpoint: it never waits for a peer, so
// it cannot hang on a dead one. A connected transport first says goodbye to
// every peer (for at most abortGrace): a peer's later exchanges with this
// rank then fail at once, naming it, and after an abort so do the ones in
// flight, which could otherwise complete on what this rank sent before it
// gave up. It returns the ranks whose endpoint UCX had not finished closing
// within abortGrace.
func (t *Transport) closeEndpoints() []int {
	if t.connected {
		C.hux_say_goodbye(t.c, C.int64_t(abortGrace))
	}
	var slow []int
	for i := 0; i < t.size; i++ {
		if C.hux_ep_force_close(t.c, C.int(i), C.int64_t(abortGrace)) != C.UCS_OK {
			slow = append(slow, i)
		}
	}
	return slow
}

// EndpointInfo describes the endpoint to peer: the transports and lanes UCX
// chose for it (ucp_ep_print_info).
func (t *Transport) EndpointInfo(peer int) (string, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.c == nil {
		return "", ErrClosed
	}
	if peer < 0 || peer >= t.size || peer == t.rank {
		return "", fmt.Errorf("ucx: endpoint info: no endpoint to rank %d", peer)
	}
	p := t.peer(peer)
	if p.ep == nil {
		if p.err == C.UCS_OK {
			return "", errNotConnected
		}
		return "", t.peerError(peer)
	}
	var n C.size_t
	s := C.hux_ep_info(p.ep, &n)
	if s == nil {
		return "", statusError("ucp_ep_print_info", C.UCS_ERR_NO_MEMORY)
	}
	defer C.free(unsafe.Pointer(s))
	return C.GoStringN(s, C.int(n)), nil
}

// peerError is what an operation on peer i fails with once it has failed.
func (t *Transport) peerError(i int) *PeerError {
	p := t.peer(i)
	return &PeerError{Rank: i, Status: Status(p.err), Cause: int(p.cause)}
}

// peer returns the C state of the endpoint to rank i.
func (t *Transport) peer(i int) *C.hux_peer_t {
	return &unsafe.Slice(t.c.peers, t.size)[i]
}
