package main

/*
#cgo CFLAGS: -I${SRCDIR}/../include
#include <stdlib.h>
#include <string.h>
#include "halo.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/halo"
)

const (
	commParamsKnown = C.HALO_COMM_PARAM_BOOTSTRAP | C.HALO_COMM_PARAM_RENDEZVOUS | C.HALO_COMM_PARAM_TOKEN |
		C.HALO_COMM_PARAM_JOB_ID | C.HALO_COMM_PARAM_TIMEOUT | C.HALO_COMM_PARAM_BOOTSTRAP_TIMEOUT
	planParamsKnown = C.HALO_PLAN_PARAM_X_STRIDES | C.HALO_PLAN_PARAM_OUT_STRIDES | C.HALO_PLAN_PARAM_GRAD_OUT_STRIDES |
		C.HALO_PLAN_PARAM_GRAD_X_STRIDES | C.HALO_PLAN_PARAM_PADDING | C.HALO_PLAN_PARAM_HALOS_ONLY |
		C.HALO_PLAN_PARAM_LEFT_STRIDES | C.HALO_PLAN_PARAM_RIGHT_STRIDES | C.HALO_PLAN_PARAM_GRAD_LEFT_STRIDES |
		C.HALO_PLAN_PARAM_GRAD_RIGHT_STRIDES | C.HALO_PLAN_PARAM_MEMORY_TYPE | C.HALO_PLAN_PARAM_DEFERRED
)

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{halo.ErrInvalid}, args...)...)
}

// exported runs the body of an exported function: its error becomes the
// result code and, reworded by lastError, the message in the caller's
// thread-local buffer (halo_last_error); a panic becomes HALO_ERR_INTERNAL
// instead of killing the caller's process.
func exported(buf *C.char, n C.size_t, body func() error) (rc C.int) {
	var err error
	defer func() { finish(&rc, recover(), err, buf, n) }()
	err = lastError(body())
	return
}

// lastError drops the words of the error's class from the front of its
// message: Go's errors read "invalid argument: rank 2 ...", and C callers
// print halo_strerror(rc), which says the same, before halo_last_error().
// The class itself, and so the result code, stays.
func lastError(err error) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	prefixes := []string{C.GoString(C.halo_strerror(C.halo_result_t(code(err))))}
	for _, class := range append([]error{errHandle}, halo.Classes...) {
		if errors.Is(err, class) {
			prefixes = append(prefixes, class.Error())
		}
	}
	for _, p := range prefixes {
		if rest, ok := strings.CutPrefix(msg, p+": "); ok && rest != "" {
			return &reworded{err: err, msg: rest}
		}
	}
	return err
}

type reworded struct {
	err error
	msg string
}

func (r *reworded) Error() string { return r.msg }
func (r *reworded) Unwrap() error { return r.err }

// cString reads an optional string field: set in the mask but NULL is an error.
func cString(mask C.uint64_t, bit C.uint64_t, p *C.char, name string) (string, error) {
	if mask&bit == 0 {
		return "", nil
	}
	if p == nil {
		return "", invalid("params->%s is NULL but its field_mask bit is set", name)
	}
	return C.GoString(p), nil
}

func cMillis(mask C.uint64_t, bit C.uint64_t, v C.int64_t, name string) (time.Duration, error) {
	if mask&bit == 0 {
		return 0, nil
	}
	if v <= 0 || v > 1<<40 {
		return 0, invalid("params->%s = %d ms is out of range (1 .. 2^40)", name, int64(v))
	}
	return time.Duration(v) * time.Millisecond, nil
}

//export haloGoCommCreate
func haloGoCommCreate(rank, size C.int, p *C.halo_comm_params_t, out *C.halo_comm_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		if out == nil {
			return invalid("comm (the output pointer) is NULL")
		}
		cfg := comm.Config{Rank: int(rank), Size: int(size)}
		if p != nil {
			m := p.field_mask
			if m&^commParamsKnown != 0 {
				return invalid("params->field_mask has unknown bits %#x (header newer than library %s?)", uint64(m&^commParamsKnown), halo.Version)
			}
			if m&C.HALO_COMM_PARAM_BOOTSTRAP != 0 {
				cfg.Bootstrap = comm.Bootstrap(p.bootstrap)
			}
			var e error
			if cfg.Rendezvous, e = cString(m, C.HALO_COMM_PARAM_RENDEZVOUS, p.rendezvous, "rendezvous"); e != nil {
				return e
			}
			if cfg.Token, e = cString(m, C.HALO_COMM_PARAM_TOKEN, p.token, "token"); e != nil {
				return e
			}
			if cfg.Job, e = cString(m, C.HALO_COMM_PARAM_JOB_ID, p.job_id, "job_id"); e != nil {
				return e
			}
			if cfg.Timeout, e = cMillis(m, C.HALO_COMM_PARAM_TIMEOUT, p.timeout_ms, "timeout_ms"); e != nil {
				return e
			}
			if cfg.BootstrapTimeout, e = cMillis(m, C.HALO_COMM_PARAM_BOOTSTRAP_TIMEOUT, p.bootstrap_timeout_ms, "bootstrap_timeout_ms"); e != nil {
				return e
			}
		}
		c, err := comm.New(cfg)
		if err != nil {
			return err
		}
		registry.Lock()
		h := newHandle(kindComm)
		registry.comms[h] = &commEntry{c: c, plans: map[uintptr]*planEntry{}}
		registry.Unlock()
		*out = *(*C.halo_comm_t)(unsafe.Pointer(&h)) // a number, never dereferenced
		return nil
	})
}

//export haloGoCommGetAddress
func haloGoCommGetAddress(h C.uintptr_t, addr *unsafe.Pointer, length *C.size_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		e, err := lookupComm(uintptr(h))
		if err != nil {
			return err
		}
		if addr == nil || length == nil {
			return invalid("address or length (output pointers) is NULL")
		}
		registry.Lock()
		defer registry.Unlock()
		a := e.c.Address()
		if e.address == nil {
			e.address = C.CBytes(a)
		}
		*addr, *length = e.address, C.size_t(len(a))
		return nil
	})
}

//export haloGoCommConnect
func haloGoCommConnect(h C.uintptr_t, addrs *unsafe.Pointer, lens *C.size_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		e, err := lookupCommBlocking(uintptr(h))
		if err != nil {
			return err
		}
		if addrs == nil || lens == nil {
			return invalid("addresses or lengths is NULL")
		}
		W := e.c.Size()
		ps, ls := unsafe.Slice(addrs, W), unsafe.Slice(lens, W)
		all := make([][]byte, W)
		for r := 0; r < W; r++ {
			if ps[r] == nil || ls[r] == 0 || ls[r] > 1<<20 {
				return invalid("rank %d: address of rank %d is NULL or has a bad length (%d)", e.c.Rank(), r, uint64(ls[r]))
			}
			all[r] = C.GoBytes(ps[r], C.int(ls[r]))
		}
		return e.c.Connect(all)
	})
}

//export haloGoCommGetRank
func haloGoCommGetRank(h C.uintptr_t, rank, size *C.int, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		e, err := lookupComm(uintptr(h))
		if err != nil {
			return err
		}
		if rank == nil || size == nil {
			return invalid("rank or world_size (output pointers) is NULL")
		}
		*rank, *size = C.int(e.c.Rank()), C.int(e.c.Size())
		return nil
	})
}

//export haloGoSettingGet
func haloGoSettingGet(name *C.char, value *C.char, n C.size_t, number *C.int64_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		if name == nil {
			return invalid("name is NULL")
		}
		if value == nil && n > 0 {
			return invalid("value is NULL but len is %d", int(n))
		}
		text, num, err := comm.SettingValue(C.GoString(name))
		if err != nil {
			return err
		}
		if value != nil {
			if len(text) >= int(n) {
				return invalid("%s=%q: the value buffer of %d bytes is too short (needs %d)", C.GoString(name), text, int(n), len(text)+1)
			}
			buf := unsafe.Slice((*byte)(unsafe.Pointer(value)), int(n))
			buf[copy(buf, text)] = 0
		}
		if number != nil {
			*number = C.int64_t(num)
		}
		return nil
	})
}

//export haloGoCommMemoryTypes
func haloGoCommMemoryTypes(h C.uintptr_t, types *C.uint64_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		e, err := lookupComm(uintptr(h))
		if err != nil {
			return err
		}
		if types == nil {
			return invalid("types (the output pointer) is NULL")
		}
		*types = C.uint64_t(e.c.MemoryTypes())
		return nil
	})
}

//export haloGoCommDestroy
func haloGoCommDestroy(h C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		registry.Lock()
		e, ok := registry.comms[uintptr(h)]
		if !ok {
			registry.Unlock()
			return badHandle(uintptr(h), "communicator", kindComm)
		}
		delete(registry.comms, uintptr(h))
		for ph := range e.plans {
			delete(registry.plans, ph)
		}
		registry.Unlock()
		e.c.EndRequests(destroyedComm(e.c.Rank()))
		// Its queued exchanges use the plans: they end first (abort the
		// communicator to make them fail at once).
		first := e.c.CloseProxy()
		for _, pe := range e.plans {
			if err := pe.p.Close(); err != nil && first == nil {
				first = err
			}
		}
		if err := e.c.Close(); err != nil && first == nil {
			first = err
		}
		if e.address != nil {
			C.free(e.address)
		}
		return first
	})
}

// readInts copies n int64s from C; the caller has validated n.
func readInts(p *C.int64_t, n int, name string) ([]int64, error) {
	if p == nil {
		return nil, fmt.Errorf("params->%s is NULL", name)
	}
	return append([]int64(nil), unsafe.Slice((*int64)(unsafe.Pointer(p)), n)...), nil
}

//export haloGoPlanCreate
func haloGoPlanCreate(h C.uintptr_t, p *C.halo_plan_params_t, out *C.halo_plan_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error { return createPlan(h, 1, p, out, false) })
}

//export haloGoPlanCreateMulti
func haloGoPlanCreateMulti(h C.uintptr_t, count C.int, p *C.halo_plan_params_t, out *C.halo_plan_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error { return createPlan(h, int(count), p, out, true) })
}

// createPlan reads count parameter structs and creates one plan over them.
func createPlan(h C.uintptr_t, count int, p *C.halo_plan_params_t, out *C.halo_plan_t, multi bool) error {
	e, err := lookupCommBlocking(uintptr(h))
	if err != nil {
		return err
	}
	if p == nil || out == nil {
		return invalid("rank %d: params or plan (the output pointer) is NULL", e.c.Rank())
	}
	if count < 1 || count > halo.MaxLayouts {
		return invalid("rank %d: count %d is out of range [1, %d]", e.c.Rank(), count, halo.MaxLayouts)
	}
	specs := make([]halo.Spec, count)
	deferred := p.field_mask&C.HALO_PLAN_PARAM_DEFERRED != 0
	for k, cp := range unsafe.Slice(p, count) {
		if (cp.field_mask&C.HALO_PLAN_PARAM_DEFERRED != 0) != deferred {
			return invalid("rank %d: params[%d] and params[0] differ in HALO_PLAN_PARAM_DEFERRED: a plan is deferred or not as a whole", e.c.Rank(), k)
		}
		pre := ""
		if multi {
			pre = fmt.Sprintf("params[%d]: ", k)
		}
		if specs[k], err = readSpec(&cp, pre); err != nil {
			return invalid("rank %d: %v", e.c.Rank(), err)
		}
	}
	plan, err := e.c.NewMultiPlan(specs, deferred)
	if err != nil {
		return err
	}
	registry.Lock()
	ph := newHandle(kindPlan)
	pe := &planEntry{p: plan, c: e.c, comm: uintptr(h), layouts: count, halosOnly: specs[0].HalosOnly}
	registry.plans[ph] = pe
	e.plans[ph] = pe
	registry.Unlock()
	*out = *(*C.halo_plan_t)(unsafe.Pointer(&ph))
	return nil
}

// readSpec turns one halo_plan_params_t into a layout; its errors are
// messages to prefix with the rank (pre names the struct of a multi plan).
func readSpec(p *C.halo_plan_params_t, pre string) (halo.Spec, error) {
	var spec halo.Spec
	m := p.field_mask
	if m&^planParamsKnown != 0 {
		return spec, fmt.Errorf("%sfield_mask has unknown bits %#x", pre, uint64(m&^planParamsKnown))
	}
	nd := int(p.ndim)
	if nd < 1 || nd > halo.MaxDims {
		return spec, fmt.Errorf("%sndim %d is out of range [1, %d]", pre, nd, halo.MaxDims)
	}
	spec = halo.Spec{DType: halo.DType(p.dtype), Dim: int(p.dim), Left: int64(p.left), Right: int64(p.right)}
	var err error
	if spec.Shape, err = readInts(p.shape, nd, pre+"shape"); err != nil {
		return spec, err
	}
	for _, s := range []struct {
		bit  C.uint64_t
		src  *C.int64_t
		dst  *[]int64
		name string
	}{
		{C.HALO_PLAN_PARAM_X_STRIDES, p.x_strides, &spec.XStrides, "x_strides"},
		{C.HALO_PLAN_PARAM_OUT_STRIDES, p.out_strides, &spec.OutStrides, "out_strides"},
		{C.HALO_PLAN_PARAM_GRAD_OUT_STRIDES, p.grad_out_strides, &spec.GradOutStrides, "grad_out_strides"},
		{C.HALO_PLAN_PARAM_GRAD_X_STRIDES, p.grad_x_strides, &spec.GradXStrides, "grad_x_strides"},
		{C.HALO_PLAN_PARAM_LEFT_STRIDES, p.left_strides, &spec.LeftStrides, "left_strides"},
		{C.HALO_PLAN_PARAM_RIGHT_STRIDES, p.right_strides, &spec.RightStrides, "right_strides"},
		{C.HALO_PLAN_PARAM_GRAD_LEFT_STRIDES, p.grad_left_strides, &spec.GradLeftStrides, "grad_left_strides"},
		{C.HALO_PLAN_PARAM_GRAD_RIGHT_STRIDES, p.grad_right_strides, &spec.GradRightStrides, "grad_right_strides"},
	} {
		if m&s.bit != 0 {
			if *s.dst, err = readInts(s.src, nd, pre+s.name); err != nil {
				return spec, err
			}
		}
	}
	if m&C.HALO_PLAN_PARAM_PADDING != 0 {
		spec.Padding = halo.Padding(p.padding)
	}
	if m&C.HALO_PLAN_PARAM_MEMORY_TYPE != 0 {
		spec.Memory = halo.MemoryType(p.memory_type)
	}
	if m&C.HALO_PLAN_PARAM_HALOS_ONLY != 0 {
		switch p.halos_only {
		case 0, 1:
			spec.HalosOnly = p.halos_only == 1
		default:
			return spec, fmt.Errorf("%shalos_only is %d, want 0 or 1", pre, int32(p.halos_only))
		}
	}
	if !spec.HalosOnly && m&(C.HALO_PLAN_PARAM_LEFT_STRIDES|C.HALO_PLAN_PARAM_RIGHT_STRIDES|C.HALO_PLAN_PARAM_GRAD_LEFT_STRIDES|C.HALO_PLAN_PARAM_GRAD_RIGHT_STRIDES) != 0 {
		return spec, fmt.Errorf("%shalo tensor strides are set for a plan with a padded output (set halos_only)", pre)
	}
	if spec.HalosOnly && m&(C.HALO_PLAN_PARAM_OUT_STRIDES|C.HALO_PLAN_PARAM_GRAD_OUT_STRIDES) != 0 {
		return spec, fmt.Errorf("%sa halos-only plan has no out or grad_out: unset their strides", pre)
	}
	return spec, nil
}

// The 0.3 plan calls, numbered as halo.Call, take the tensors of their
// exchange in the order of halo_exchange (see include/halo.h). The blocking
// single-layout ones are halo_exchange calls in halo.c; the start forms stay
// here, finished by halo_plan_wait or halo_plan_test, not by a request.

//export haloGoPlanStart
func haloGoPlanStart(h C.uintptr_t, call C.int, a, b, c unsafe.Pointer, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		pe, err := lookupPlanBlocking(uintptr(h))
		if err != nil {
			return err
		}
		return pe.p.Do(halo.Call(call), false, a, b, c)
	})
}

// haloGoPlanMulti runs the *_multi calls: the blocking ones as halo_exchange
// (halo.c cannot lay their arrays out as its buffers: it does not know the
// plan's number of layouts), the start forms on the plan.
//
//export haloGoPlanMulti
func haloGoPlanMulti(h C.uintptr_t, call, start C.int, a, b, c *unsafe.Pointer, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		pe, err := lookupPlan(uintptr(h))
		if err != nil {
			return err
		}
		K := pe.layouts
		var xs [3][]unsafe.Pointer
		for i, p := range []*unsafe.Pointer{a, b, c} {
			if p != nil {
				xs[i] = unsafe.Slice(p, K)
			}
		}
		if start != 0 {
			if _, err := lookupPlanBlocking(uintptr(h)); err != nil {
				return err
			}
			return pe.p.DoMulti(halo.Call(call), false, xs[0], xs[1], xs[2])
		}
		dir, per := halo.DirForward, 2
		switch halo.Call(call) {
		case halo.CallBackward:
			dir = halo.DirBackward
		case halo.CallHalosForward:
			per = 3
		case halo.CallHalosBackward:
			dir, per = halo.DirBackward, 3
		}
		var bufs [3 * halo.MaxLayouts]unsafe.Pointer
		for k := 0; k < per; k++ {
			if xs[k] == nil {
				return invalid("rank %d: argument %d of the multi call is NULL (an array of %d tensors, one per layout)", pe.p.Rank(), k+1, K)
			}
			for l, t := range xs[k] {
				bufs[l*per+k] = t
			}
		}
		return exchange(uintptr(h), C.int(dir), &bufs[0], C.size_t(per*K), 0)
	})
}

//export haloGoPlanTest
func haloGoPlanTest(h C.uintptr_t, dir C.int, done *C.int, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		pe, err := lookupPlan(uintptr(h))
		if err != nil {
			return err
		}
		if done == nil {
			return invalid("done (the output pointer) is NULL")
		}
		if err := ownedExchange(pe, dir); err != nil {
			return err
		}
		if !pe.c.Quiet() { // the stream-ordered exchanges progress it
			*done = 0
			return nil
		}
		ok, err := pe.p.Test(halo.Direction(dir))
		if err == nil {
			*done = 0
			if ok {
				*done = 1
			}
		}
		return err
	})
}

//export haloGoPlanWait
func haloGoPlanWait(h C.uintptr_t, dir C.int, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		pe, err := lookupPlanBlocking(uintptr(h))
		if err != nil {
			return err
		}
		if err := ownedExchange(pe, dir); err != nil {
			return err
		}
		return pe.p.Wait(halo.Direction(dir))
	})
}

//export haloGoCommAbort
func haloGoCommAbort(h C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		e, err := lookupComm(uintptr(h))
		if err != nil {
			return err
		}
		e.c.Abort() // the queued stream-ordered exchanges first
		return nil
	})
}

//export haloGoPlanDestroy
func haloGoPlanDestroy(h C.uintptr_t, eb *C.char, el C.size_t) C.int {
	return exported(eb, el, func() error {
		registry.Lock()
		pe, ok := registry.plans[uintptr(h)]
		if ok {
			delete(registry.plans, uintptr(h))
			if ce, ok := registry.comms[pe.comm]; ok {
				delete(ce.plans, uintptr(h))
			}
		}
		registry.Unlock()
		if !ok {
			return badHandle(uintptr(h), "plan", kindPlan)
		}
		return pe.c.ClosePlan(pe.p) // after the stream-ordered exchanges queued on it
	})
}
