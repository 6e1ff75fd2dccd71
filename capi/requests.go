package main

/*
#include "halo.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/cuda"
	"github.com/halo-cp/halo/halo"
)

// A request is one exchange started by halo_exchange_start: on the calling
// thread (no stream; the plan's own start, test and wait) or on a stream
// (the communicator's proxy runs the plan's blocking call in stream order).
type requestEntry struct {
	plan   uintptr
	pe     *planEntry
	comm   uintptr
	dir    halo.Direction
	stream *cuda.Request // nil: a host request
	ended  bool
	err    error // the exchange's result, once ended
	// gone is set when the communicator is destroyed: the request has
	// ended, and its stream flag is freed, so every later call but free
	// fails with it.
	gone error
}

// end records the result of a host request the first time it is known,
// and gives the plan's direction back to the 0.3 calls.
func (r *requestEntry) end(err error) error {
	if !r.ended {
		r.ended, r.err = true, err
		registry.Lock()
		if r.pe.owner[r.dir] == r {
			r.pe.owner[r.dir] = nil
		}
		registry.Unlock()
	}
	return r.err
}

// endRequests ends the requests of a communicator being destroyed; the
// caller holds the registry's lock.
func endRequests(comm uintptr, rank int) {
	for _, r := range registry.requests {
		if r.comm == comm && r.gone == nil {
			r.gone = fmt.Errorf("%w: rank %d: the request's communicator was destroyed (halo_comm_destroy): the request has ended; only halo_request_free is left", halo.ErrState, rank)
		}
	}
}

// ownedExchange refuses halo_plan_wait and halo_plan_test on an exchange
// that halo_exchange_start began: the request finishes its own exchange,
// else its wait would finish the next one started on the plan.
func ownedExchange(pe *planEntry, dir C.int) error {
	if dir != C.int(halo.DirForward) && dir != C.int(halo.DirBackward) {
		return nil // the plan says what is wrong with it
	}
	registry.Lock()
	r := pe.owner[dir]
	registry.Unlock()
	if r == nil {
		return nil
	}
	what := map[halo.Direction]string{halo.DirForward: "forward", halo.DirBackward: "backward"}[halo.Direction(dir)]
	return fmt.Errorf("%w: the %s exchange in flight on this plan belongs to a request (halo_exchange_start): finish it with halo_request_wait or halo_request_test on that request",
		halo.ErrState, what)
}

// classed gives an error of the proxy or the driver a halo class, so that
// it maps to a result code: an abort is the communicator's failure, a CUDA
// error the transport's.
func classed(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, cuda.ErrAborted):
		return fmt.Errorf("%w: %v", halo.ErrFailed, err)
	}
	for _, c := range halo.Classes {
		if errors.Is(err, c) {
			return err
		}
	}
	return fmt.Errorf("%w: CUDA: %v", halo.ErrTransport, err)
}

func lookupRequest(h uintptr) (*requestEntry, error) {
	registry.Lock()
	defer registry.Unlock()
	if r, ok := registry.requests[h]; ok {
		return r, nil
	}
	return nil, badHandle(h, "request", kindRequest)
}

// proxyOf returns the communicator's proxy, made on its first stream-ordered
// exchange, or why there can be none (no CUDA driver).
func proxyOf(ce *commEntry) (*cuda.Proxy, error) {
	registry.Lock()
	defer registry.Unlock()
	if ce.proxy != nil {
		return ce.proxy, nil
	}
	kind := ce.c.Config().CUDADriver
	drv, err := cuda.Load(kind)
	if err != nil {
		if kind != "cuda" {
			err = fmt.Errorf("%s=%s: %v", comm.SettingCUDADriver.Env, kind, err)
		}
		return nil, invalid("rank %d: a stream was given but %v", ce.c.Config().Rank, err)
	}
	if ce.proxy, err = cuda.NewProxy(drv); err != nil {
		return nil, fmt.Errorf("%w: the stream-ordered proxy (%s driver): %v", halo.ErrTransport, drv.Name(), err)
	}
	return ce.proxy, nil
}

// exchangeArgs reads halo_exchange's buffers for the direction of plan pe:
// the call it makes and the pointers as halo_exchange takes them, count of
// them, one group of per per layout. The slice views the caller's array.
func exchangeArgs(pe *planEntry, dir C.int, buffers *unsafe.Pointer, count C.size_t) (halo.Call, int, []unsafe.Pointer, error) {
	call, per := halo.CallForward, 2
	switch {
	case halo.Direction(dir) != halo.DirForward && halo.Direction(dir) != halo.DirBackward:
		return 0, 0, nil, invalid("direction %d is neither HALO_DIR_FORWARD (0) nor HALO_DIR_BACKWARD (1)", int(dir))
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
			return 0, 0, nil, invalid("buffers is NULL; this plan's exchange takes %d pointers (%s for each of its %d layouts)", want, form, pe.layouts)
		}
		// The other kind's count: the caller has the other kind of plan in
		// mind (the 0.3 halos calls on a padded plan, or the reverse).
		kind := ""
		if other := (5 - per) * pe.layouts; int(count) == other && pe.halosOnly {
			kind = "; this plan is halos-only: use the halos calls"
		} else if int(count) == other {
			kind = "; this plan has a padded output: use forward and backward, not the halos calls"
		}
		return 0, 0, nil, invalid("count is %d but this plan's exchange takes %d buffers (%s for each of its %d layouts)%s", int(count), want, form, pe.layouts, kind)
	}
	return call, per, unsafe.Slice(buffers, int(count)), nil
}

// runExchange runs (wait) or starts the call on the plan with bufs as
// exchangeArgs reads them: the one body of halo_exchange and
// halo_exchange_start on the host and on a stream.
func runExchange(p *halo.Plan, call halo.Call, per int, bufs []unsafe.Pointer, wait bool) error {
	if len(bufs) == per { // one layout: no per-argument slices to build
		var a2 unsafe.Pointer
		if per == 3 {
			a2 = bufs[2]
		}
		return p.Do(call, wait, bufs[0], bufs[1], a2)
	}
	// Per argument, one pointer per layout, as DoMulti takes them.
	var args [3][]unsafe.Pointer
	for k := 0; k < per; k++ {
		for l := k; l < len(bufs); l += per {
			args[k] = append(args[k], bufs[l])
		}
	}
	return p.DoMulti(call, wait, args[0], args[1], args[2])
}

// startOnStream queues run on the stream, in the order of the proxy of
// the plan's communicator.
func startOnStream(pe *planEntry, stream uintptr, run func() error) (*cuda.Request, error) {
	ce, err := lookupComm(pe.comm)
	if err != nil {
		return nil, err
	}
	px, err := proxyOf(ce)
	if err != nil {
		return nil, err
	}
	r, err := px.Start(cuda.Stream(stream), run)
	if err != nil {
		if errors.Is(err, cuda.ErrAborted) {
			return nil, fmt.Errorf("rank %d: stream %#x: %w", ce.c.Config().Rank, stream, classed(err))
		}
		return nil, invalid("rank %d: stream %#x: %v", ce.c.Config().Rank, stream, err)
	}
	return r, nil
}

//export haloGoExchange
func haloGoExchange(h C.uintptr_t, dir C.int, buffers *unsafe.Pointer, count C.size_t, stream C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error { return exchange(uintptr(h), dir, buffers, count, uintptr(stream)) })
}

// exchange is halo_exchange: halo_exchange_start, a host wait and a free,
// without the request.
func exchange(h uintptr, dir C.int, buffers *unsafe.Pointer, count C.size_t, stream uintptr) error {
	pe, err := lookupPlan(h)
	if err != nil {
		return err
	}
	call, per, bufs, err := exchangeArgs(pe, dir, buffers, count)
	if err != nil {
		return err
	}
	if stream == 0 {
		if _, err := hostPlan(h); err != nil { // after the stream-ordered ones
			return err
		}
		return runExchange(pe.p, call, per, bufs, true)
	}
	// The caller's array outlives the exchange: this call waits for it.
	r, err := startOnStream(pe, stream, func() error { return runExchange(pe.p, call, per, bufs, true) })
	if err != nil {
		return err
	}
	return classed(r.Wait())
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
		call, per, view, err := exchangeArgs(pe, dir, buffers, count)
		if err != nil {
			return err
		}
		bufs := append([]unsafe.Pointer(nil), view...) // the exchange outlives the caller's array
		r := &requestEntry{plan: uintptr(h), pe: pe, comm: pe.comm, dir: halo.Direction(dir)}
		if stream == 0 {
			if _, err := hostPlan(uintptr(h)); err != nil { // after the stream-ordered ones
				return err
			}
			if err := runExchange(pe.p, call, per, bufs, false); err != nil {
				return err
			}
			registry.Lock()
			pe.owner[r.dir] = r
			registry.Unlock()
		} else if r.stream, err = startOnStream(pe, uintptr(stream), func() error { return runExchange(pe.p, call, per, bufs, true) }); err != nil {
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
		ok, err := r.test()
		*done = 0
		if ok {
			*done = 1
		}
		return err
	})
}

func (r *requestEntry) test() (bool, error) {
	if r.gone != nil {
		return true, r.gone
	}
	if r.ended {
		return true, r.err
	}
	if r.stream != nil {
		ok, err := r.stream.Test()
		if ok {
			return true, r.end(classed(err))
		}
		return false, nil
	}
	pe, quiet, err := hostPlanNow(r.plan)
	if err != nil {
		return true, r.end(fmt.Errorf("%w: the request's plan was destroyed while its exchange was in flight", halo.ErrState))
	}
	if !quiet {
		return false, nil
	}
	ok, err := pe.p.Test(r.dir)
	if ok || err != nil {
		return true, r.end(err)
	}
	return false, nil
}

//export haloGoRequestWait
func haloGoRequestWait(h C.uintptr_t, stream C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		r, err := lookupRequest(uintptr(h))
		if err != nil {
			return err
		}
		if r.gone != nil {
			return r.gone // never a stream wait on the freed flag
		}
		if stream != 0 {
			if r.stream == nil {
				return invalid("stream %#x: this request was started without a stream; wait for it with stream NULL", uintptr(stream))
			}
			return classed(r.stream.WaitOn(cuda.Stream(uintptr(stream))))
		}
		if r.ended {
			return r.err
		}
		if r.stream != nil {
			return r.end(classed(r.stream.Wait()))
		}
		pe, err := hostPlan(r.plan)
		if err != nil {
			return r.end(fmt.Errorf("%w: the request's plan was destroyed while its exchange was in flight", halo.ErrState))
		}
		return r.end(pe.p.Wait(r.dir))
	})
}

//export haloGoRequestFree
func haloGoRequestFree(h C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		r, err := lookupRequest(uintptr(h))
		if err != nil {
			return err
		}
		if ok, _ := r.test(); !ok {
			return fmt.Errorf("%w: the request's exchange has not ended (wait for it first)", halo.ErrState)
		}
		if r.stream != nil {
			if err := r.stream.Free(); err != nil && !errors.Is(err, cuda.ErrNotDone) {
				return err
			}
		}
		registry.Lock()
		delete(registry.requests, uintptr(h))
		registry.Unlock()
		return nil
	})
}
