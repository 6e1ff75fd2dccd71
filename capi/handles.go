package main

import (
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/cuda"
	"github.com/halo-cp/halo/halo"
)

// Handles given to C are numbers, never pointers: a kind in the top byte and
// a serial that is never reused, so a NULL, stale or foreign handle is found
// out by a map lookup instead of crashing the caller.
const (
	kindComm    = 0xC0
	kindPlan    = 0xB1
	kindRequest = 0xD3
)

type commEntry struct {
	c       *comm.Comm
	plans   map[uintptr]*planEntry
	address unsafe.Pointer // C copy of the worker address, made on demand
	proxy   *cuda.Proxy    // runs stream-ordered exchanges; made on the first
	// pid is the process that made the communicator. A forked child
	// inherits the registry but not the communicator: its transport's
	// endpoints, shared memory and epoll sets are the parent's, so the
	// child's destroy only forgets it (see inherited).
	pid int
}

type planEntry struct {
	p    *halo.Plan
	comm uintptr
	// What halo_exchange needs of the plan on every call, read once.
	layouts   int
	halosOnly bool
	// owner is the host request whose exchange is in flight in each
	// direction (halo.DirForward, halo.DirBackward), nil when none is.
	owner [2]*requestEntry
}

var registry = struct {
	sync.Mutex
	next     uint64
	comms    map[uintptr]*commEntry
	plans    map[uintptr]*planEntry
	requests map[uintptr]*requestEntry
}{next: 1, comms: map[uintptr]*commEntry{}, plans: map[uintptr]*planEntry{}, requests: map[uintptr]*requestEntry{}}

func newHandle(kind uint64) uintptr {
	h := uintptr(kind<<56 | registry.next)
	registry.next++
	return h
}

func kindName(h uintptr) string {
	switch uint64(h) >> 56 {
	case kindComm:
		return "a communicator handle"
	case kindPlan:
		return "a plan handle"
	case kindRequest:
		return "a request handle"
	}
	return "not a halo handle"
}

func lookupComm(h uintptr) (*commEntry, error) {
	registry.Lock()
	defer registry.Unlock()
	if e, ok := registry.comms[h]; ok {
		return e, nil
	}
	return nil, badHandle(h, "communicator", kindComm)
}

func lookupPlan(h uintptr) (*planEntry, error) {
	registry.Lock()
	defer registry.Unlock()
	if e, ok := registry.plans[h]; ok {
		return e, nil
	}
	return nil, badHandle(h, "plan", kindPlan)
}

// hostPlan is lookupPlan for a call that runs on the caller's thread. It
// first waits for the stream-ordered exchanges queued on the plan's
// communicator: the proxy thread then no longer drives the communicator
// (one thread at a time may), and the call takes its call number after
// theirs, in the order the caller made the calls, which every rank shares
// (messages are matched across ranks by that number).
func hostPlan(h uintptr) (*planEntry, error) {
	pe, px, err := planAndProxy(h)
	if px != nil {
		px.Idle()
	}
	return pe, err
}

// hostPlanNow is hostPlan for the calls that must not block (tests): quiet
// is false, and the caller does nothing, while stream-ordered exchanges are
// queued on the communicator (they progress its host requests too).
func hostPlanNow(h uintptr) (pe *planEntry, quiet bool, err error) {
	pe, px, err := planAndProxy(h)
	return pe, px == nil || px.Quiet(), err
}

func planAndProxy(h uintptr) (*planEntry, *cuda.Proxy, error) {
	registry.Lock()
	defer registry.Unlock()
	pe, ok := registry.plans[h]
	if !ok {
		return nil, nil, badHandle(h, "plan", kindPlan)
	}
	if ce := registry.comms[pe.comm]; ce != nil {
		return pe, ce.proxy, nil
	}
	return pe, nil, nil
}

// hostComm is lookupComm for a call on the caller's thread that drives the
// communicator (connecting, creating a plan): as hostPlan.
func hostComm(h uintptr) (*commEntry, error) {
	registry.Lock()
	e, ok := registry.comms[h]
	var px *cuda.Proxy
	if ok {
		px = e.proxy
	}
	registry.Unlock()
	if !ok {
		return nil, badHandle(h, "communicator", kindComm)
	}
	if px != nil {
		px.Idle()
	}
	return e, nil
}

func badHandle(h uintptr, want string, kind uint64) error {
	switch {
	case h == 0:
		return fmt.Errorf("%w: the %s handle is NULL", errHandle, want)
	case uint64(h)>>56 == kind:
		return fmt.Errorf("%w: %s handle %#x is not live (already destroyed?)", errHandle, want, h)
	}
	return fmt.Errorf("%w: %#x is %s, not a live %s", errHandle, h, kindName(h), want)
}

// inherited reports whether the communicator was made by another process
// than this one: this is a fork of its maker (an atexit handler or a
// finaliser in the child is the usual caller). Such a destroy must stay
// local: a goodbye would tell the peers that the parent is gone, and
// closing UCX would tear down state the parent still uses.
func inherited(e *commEntry) bool {
	return e.pid != os.Getpid()
}
