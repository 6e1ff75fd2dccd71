package main

/*
#include "halo.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/halo"
)

// Requests are comm.Requests behind handles: this file translates the C
// calls of the exchange pair and the requests to comm's (comm/requests.go).

// ownedExchange refuses halo_plan_wait and halo_plan_test on an exchange
// that halo_exchange_start began: the request finishes its own exchange,
// else its wait would finish the next one started on the plan.
func ownedExchange(pe *planEntry, dir C.int) error {
	if !pe.c.Owned(pe.p, halo.Direction(dir)) {
		return nil
	}
	what := map[halo.Direction]string{halo.DirForward: "forward", halo.DirBackward: "backward"}[halo.Direction(dir)]
	return fmt.Errorf("%w: the %s exchange in flight on this plan belongs to a request (halo_exchange_start): finish it with halo_request_wait or halo_request_test on that request",
		halo.ErrState, what)
}

// destroyedComm is why a request of a destroyed communicator has ended.
func destroyedComm(rank int) error {
	return fmt.Errorf("%w: rank %d: the request's communicator was destroyed (halo_comm_destroy): the request has ended; only halo_request_free is left", halo.ErrState, rank)
}

func lookupRequest(h uintptr) (*comm.Request, error) {
	registry.Lock()
	defer registry.Unlock()
	if r, ok := registry.requests[h]; ok {
		return r, nil
	}
	return nil, badHandle(h, "request", kindRequest)
}

// exchangeArgs checks halo_exchange's buffers for the direction of plan pe,
// saying what was expected, and returns them: a view of the caller's array.
func exchangeArgs(pe *planEntry, dir C.int, buffers *unsafe.Pointer, count C.size_t) ([]unsafe.Pointer, error) {
	call, per := halo.CallForward, 2
	switch {
	case halo.Direction(dir) != halo.DirForward && halo.Direction(dir) != halo.DirBackward:
		return nil, invalid("direction %d is neither HALO_DIR_FORWARD (0) nor HALO_DIR_BACKWARD (1)", int(dir))
	case pe.halosOnly && halo.Direction(dir) == halo.DirForward:
		call, per = halo.CallHalosForward, 3
	case pe.halosOnly:
		call, per = halo.CallHalosBackward, 3
	case halo.Direction(dir) == halo.DirBackward:
		call = halo.CallBackward
	}
	if want := per * pe.layouts; int(count) != want || buffers == nil {
		form := map[halo.Call]string{halo.CallForward: "x, out", halo.CallBackward: "grad_out, grad_x",
			halo.CallHalosForward: "x, left, right", halo.CallHalosBackward: "grad_left, grad_right, grad_x"}[call]
		if buffers == nil {
			return nil, invalid("buffers is NULL; this plan's exchange takes %d pointers (%s for each of its %d layouts)", want, form, pe.layouts)
		}
		// The other kind's count: the caller has the other kind of plan in
		// mind (the 0.3 halos calls on a padded plan, or the reverse).
		kind := ""
		if other := (5 - per) * pe.layouts; int(count) == other && pe.halosOnly {
			kind = "; this plan is halos-only: use the halos calls"
		} else if int(count) == other {
			kind = "; this plan has a padded output: use forward and backward, not the halos calls"
		}
		return nil, invalid("count is %d but this plan's exchange takes %d buffers (%s for each of its %d layouts)%s", int(count), want, form, pe.layouts, kind)
	}
	return unsafe.Slice(buffers, int(count)), nil
}

//export haloGoExchange
func haloGoExchange(h C.uintptr_t, dir C.int, buffers *unsafe.Pointer, count C.size_t, stream C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error { return exchange(uintptr(h), dir, buffers, count, uintptr(stream)) })
}

func exchange(h uintptr, dir C.int, buffers *unsafe.Pointer, count C.size_t, stream uintptr) error {
	pe, err := lookupPlan(h)
	if err != nil {
		return err
	}
	bufs, err := exchangeArgs(pe, dir, buffers, count)
	if err != nil {
		return err
	}
	return pe.c.Exchange(pe.p, halo.Direction(dir), bufs, stream)
}

//export haloGoExchangeStart
func haloGoExchangeStart(h C.uintptr_t, dir C.int, buffers *unsafe.Pointer, count C.size_t, stream C.uintptr_t,
	out *C.halo_request_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		pe, err := lookupPlan(uintptr(h))
		if err != nil {
			return err
		}
		if out == nil {
			return invalid("request (the output pointer) is NULL")
		}
		bufs, err := exchangeArgs(pe, dir, buffers, count)
		if err != nil {
			return err
		}
		r, err := pe.c.Start(pe.p, halo.Direction(dir), bufs, uintptr(stream))
		if err != nil {
			return err
		}
		registry.Lock()
		rh := newHandle(kindRequest)
		registry.requests[rh] = r
		registry.Unlock()
		*out = *(*C.halo_request_t)(unsafe.Pointer(&rh)) // a number, never dereferenced
		return nil
	})
}

//export haloGoRequestTest
func haloGoRequestTest(h C.uintptr_t, done *C.int, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		r, err := lookupRequest(uintptr(h))
		if err != nil {
			return err
		}
		if done == nil {
			return invalid("done (the output pointer) is NULL")
		}
		ok, err := r.Test()
		*done = 0
		if ok {
			*done = 1
		}
		return err
	})
}

//export haloGoRequestWait
func haloGoRequestWait(h C.uintptr_t, stream C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		r, err := lookupRequest(uintptr(h))
		if err != nil {
			return err
		}
		if stream != 0 {
			return r.WaitOn(uintptr(stream))
		}
		return r.Wait()
	})
}

//export haloGoRequestFree
func haloGoRequestFree(h C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		r, err := lookupRequest(uintptr(h))
		if err != nil {
			return err
		}
		if err := r.Free(); err != nil {
			return err
		}
		registry.Lock()
		delete(registry.requests, uintptr(h))
		registry.Unlock()
		return nil
	})
}
