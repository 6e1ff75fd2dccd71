package main

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/halo-cp/halo/comm"
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
	// A forked child never gets here: halo.c refuses or forgets its calls.
}

type planEntry struct {
	p    *halo.Plan
	c    *comm.Comm // the communicator the plan was made on
	comm uintptr    // its handle
	// What halo_exchange needs of the plan on every call, read once.
	layouts   int
	halosOnly bool
}

var registry = struct {
	sync.Mutex
	next     uint64
	comms    map[uintptr]*commEntry
	plans    map[uintptr]*planEntry
	requests map[uintptr]*comm.Request
}{next: 1, comms: map[uintptr]*commEntry{}, plans: map[uintptr]*planEntry{}, requests: map[uintptr]*comm.Request{}}

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

// lookupPlanBlocking is lookupPlan for a call that runs on the caller's
// thread, and it blocks: it first waits for the stream-ordered exchanges
// queued on the plan's communicator (comm.Comm.Quiesce), so that the call
// takes its number after theirs, in the order the caller made the calls,
// which every rank shares.
func lookupPlanBlocking(h uintptr) (*planEntry, error) {
	pe, err := lookupPlan(h)
	if err == nil {
		pe.c.Quiesce()
	}
	return pe, err
}

// lookupCommBlocking is lookupComm for a call on the caller's thread that drives the
// communicator (connecting, creating a plan): as lookupPlanBlocking.
func lookupCommBlocking(h uintptr) (*commEntry, error) {
	e, err := lookupComm(h)
	if err == nil {
		e.c.Quiesce()
	}
	return e, err
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
