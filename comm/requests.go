package comm

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/halo-cp/halo/cuda"
	"github.com/halo-cp/halo/halo"
)

// The communicator's exchanges, blocking or started, on the host or ordered
// on a CUDA stream, and the requests that finish the started ones. NCCL's
// proxy belongs to its communicator; so do the proxy and the requests here,
// so that the C ABI only translates and a Go caller (halod) has the stream
// path too.
//
// A stream-ordered exchange runs on the proxy's thread, in the order the
// exchanges were started; a call that works on the host first waits for
// the queued ones (Quiesce), so that every rank runs its exchanges in the
// order of its calls, which is how messages are matched across ranks.

// streams is the stream-ordered state of a Comm; its zero value has no
// proxy yet (one is made on the first stream-ordered exchange).
type streams struct {
	mu    sync.Mutex
	proxy *cuda.Proxy
	// owners holds, per plan and direction, the host request whose
	// exchange is in flight: only it finishes that exchange.
	owners map[*halo.Plan]*[2]*Request
	// gone, once set, is why every request has ended (its communicator
	// was closed): every later call on one but Free returns it.
	gone error
	// detached holds the host requests freed before their exchange ended,
	// in the order they were freed: the next call that blocks on the
	// host finishes them first (Quiesce), a request's Test progresses them.
	detached []*Request
	// lost is the first failure of an exchange whose request was freed
	// before its caller was told its result (halocp frees a request once a
	// stream was told to wait for it, as NCCL's callers never see an
	// operation's own result): the next exchange the communicator is asked
	// to run or start returns it, once, instead of running, so that the
	// results a stream read are known to be invalid.
	lost error
	// freedStreams holds the stream-ordered requests freed before their
	// exchange ended, in the order started (the proxy's): each call that
	// may report lost first looks at those that have ended since.
	freedStreams []*Request
}

// Request is one exchange started by Start: on the host (the plan's own
// start, test and wait) or on a stream (the proxy runs the plan's blocking
// exchange in stream order). One goroutine at a time uses a request, as its
// communicator.
type Request struct {
	c      *Comm
	p      *halo.Plan
	dir    halo.Direction
	stream *cuda.Request // nil: a host request
	ended  bool
	err    error // the exchange's result, once ended
	// planGone is set when the plan is closed with the exchange in flight.
	planGone bool
	// told: Test or Wait has given the caller the exchange's result.
	told bool
}

// Exchange runs the direction's exchange of p, whose tensors bufs holds as
// halo_exchange takes them (per layout, in the order of the plan's specs:
// x, out; grad_out, grad_x; x, left, right; grad_left, grad_right, grad_x),
// and returns when it has ended. stream 0: on the calling goroutine; else
// ordered on that CUDA stream by the proxy while the caller waits.
func (c *Comm) Exchange(p *halo.Plan, d halo.Direction, bufs []unsafe.Pointer, stream uintptr) error {
	if stream == 0 {
		c.Quiesce()
		if err := c.takeLost(); err != nil {
			return err
		}
		return runExchange(p, d, bufs, true)
	}
	// bufs outlives the exchange: this call waits for it.
	r, err := c.startOnStream(stream, func() error { return runExchange(p, d, bufs, true) })
	if err != nil {
		return err
	}
	return classed(r.Wait())
}

// Start starts the exchange Exchange runs and returns at once with its
// request. bufs is copied. On the host, the local work that needs nothing
// from the wire is done before it returns.
func (c *Comm) Start(p *halo.Plan, d halo.Direction, bufs []unsafe.Pointer, stream uintptr) (*Request, error) {
	bufs = append([]unsafe.Pointer(nil), bufs...)
	r := &Request{c: c, p: p, dir: d}
	if stream != 0 {
		var err error
		if r.stream, err = c.startOnStream(stream, func() error { return runExchange(p, d, bufs, true) }); err != nil {
			return nil, err
		}
		return r, nil
	}
	c.Quiesce()
	if err := c.takeLost(); err != nil {
		return nil, err
	}
	if err := runExchange(p, d, bufs, false); err != nil {
		return nil, err
	}
	c.st.mu.Lock()
	if c.st.owners == nil {
		c.st.owners = map[*halo.Plan]*[2]*Request{}
	}
	if c.st.owners[p] == nil {
		c.st.owners[p] = &[2]*Request{}
	}
	c.st.owners[p][d] = r
	c.st.mu.Unlock()
	return r, nil
}

// runExchange runs (wait) or starts the direction's exchange of p with
// bufs as Exchange takes them.
func runExchange(p *halo.Plan, d halo.Direction, bufs []unsafe.Pointer, wait bool) error {
	halos := p.Spec().HalosOnly
	call, per := halo.CallForward, 2
	switch {
	case halos && d == halo.DirForward:
		call, per = halo.CallHalosForward, 3
	case halos:
		call, per = halo.CallHalosBackward, 3
	case d == halo.DirBackward:
		call = halo.CallBackward
	}
	if len(bufs) == per { // one layout: no per-argument slices to build
		var a2 unsafe.Pointer
		if per == 3 {
			a2 = bufs[2]
		}
		return p.Do(call, wait, bufs[0], bufs[1], a2)
	}
	// Per argument, one pointer per layout, as DoMulti takes them (it
	// says so if their numbers do not match the plan's layouts).
	var args [3][]unsafe.Pointer
	for k := 0; k < per; k++ {
		for l := k; l < len(bufs); l += per {
			args[k] = append(args[k], bufs[l])
		}
	}
	return p.DoMulti(call, wait, args[0], args[1], args[2])
}

// startOnStream queues run on the stream, in the proxy's order. A host
// exchange whose request was freed is finished first: the proxy must not
// drive the communicator while the host has one to finish. A lost failure
// is returned instead.
func (c *Comm) startOnStream(stream uintptr, run func() error) (*cuda.Request, error) {
	c.settleDetached(true)
	if err := c.takeLost(); err != nil {
		return nil, err
	}
	px, err := c.proxy()
	if err != nil {
		return nil, err
	}
	r, err := px.Start(cuda.Stream(stream), run)
	if err != nil {
		if errors.Is(err, cuda.ErrAborted) {
			// A freed exchange the abort ended says more: once the proxy
			// is idle (the abort ends the running one), it is known.
			px.Idle()
			if lost := c.takeLost(); lost != nil {
				return nil, lost
			}
			return nil, fmt.Errorf("rank %d: stream %#x: %w", c.cfg.Rank, stream, classed(err))
		}
		return nil, fmt.Errorf("%w: rank %d: stream %#x: %v", halo.ErrInvalid, c.cfg.Rank, stream, err)
	}
	return r, nil
}

// proxy returns the communicator's proxy, made on its first stream-ordered
// exchange, or why there can be none (no CUDA driver).
func (c *Comm) proxy() (*cuda.Proxy, error) {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	if c.st.proxy != nil {
		return c.st.proxy, nil
	}
	kind := c.cfg.CUDADriver
	drv, err := cuda.Load(kind)
	if err != nil {
		if kind != "cuda" {
			err = fmt.Errorf("%s=%s: %v", SettingCUDADriver.Env, kind, err)
		}
		return nil, fmt.Errorf("%w: rank %d: a stream was given but %v", halo.ErrInvalid, c.cfg.Rank, err)
	}
	if c.st.proxy, err = cuda.NewProxy(drv); err != nil {
		return nil, fmt.Errorf("%w: the stream-ordered proxy (%s driver): %v", halo.ErrTransport, drv.Name(), err)
	}
	return c.st.proxy, nil
}

func (c *Comm) currentProxy() *cuda.Proxy {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	return c.st.proxy
}

// Quiesce waits for the stream-ordered exchanges queued on the
// communicator, and finishes the host exchanges whose requests were freed
// before they ended: a call on the host does, before it drives the
// communicator (one goroutine at a time may) and takes its call number
// after theirs.
func (c *Comm) Quiesce() {
	if px := c.currentProxy(); px != nil {
		px.Idle()
	}
	c.settleDetached(true)
}

// settleDetached finishes the freed host requests' exchanges (wait: Wait
// on each, else Test, keeping those not done); a failure is lost's.
func (c *Comm) settleDetached(wait bool) {
	c.st.mu.Lock()
	list := c.st.detached
	c.st.detached = nil
	c.st.mu.Unlock()
	var left []*Request
	for _, r := range list {
		switch {
		case r.ended || r.planGone:
		case wait:
			c.lose(r, r.end(r.p.Wait(r.dir)))
		default:
			if ok, err := r.p.Test(r.dir); ok || err != nil {
				c.lose(r, r.end(err))
			} else {
				left = append(left, r)
			}
		}
	}
	if len(left) > 0 {
		c.st.mu.Lock()
		c.st.detached = append(left, c.st.detached...)
		c.st.mu.Unlock()
	}
}

// Quiet reports whether no stream-ordered exchange is queued (Quiesce would
// return at once): a call that must not block does nothing meanwhile.
func (c *Comm) Quiet() bool {
	px := c.currentProxy()
	return px == nil || px.Quiet()
}

// Owned reports whether the direction's exchange in flight on p belongs to
// a request, which alone may finish it (else a plan's wait would finish
// the exchange and the request's wait the next one).
func (c *Comm) Owned(p *halo.Plan, d halo.Direction) bool {
	if d != halo.DirForward && d != halo.DirBackward {
		return false
	}
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	o := c.st.owners[p]
	return o != nil && o[d] != nil
}

// ClosePlan closes p once the stream-ordered exchanges queued on it have
// ended; a host request whose exchange was in flight on it ends, saying so,
// and its exchange is cancelled (a freed one's too: a destroy never waits
// for the wire).
func (c *Comm) ClosePlan(p *halo.Plan) error {
	c.forgetPlan(p)
	c.Quiesce()
	return p.Close()
}

// forgetPlan ends the host requests in flight on p.
func (c *Comm) forgetPlan(p *halo.Plan) {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	if o := c.st.owners[p]; o != nil {
		for _, r := range o {
			if r != nil {
				r.planGone = true
			}
		}
		delete(c.st.owners, p)
	}
}

// EndRequests ends every request of the communicator: why is what every
// later call on one but Free returns. It touches neither the proxy nor the
// driver (a forked child calls it too). The first reason stays.
func (c *Comm) EndRequests(why error) {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	if c.st.gone == nil {
		c.st.gone = why
	}
	c.st.detached = nil // the plans' close cancels their exchanges
	c.st.freedStreams = nil
}

// closeProxy ends the requests (if EndRequests has not) and the proxy,
// once its queued exchanges have run: they use the plans, which the caller
// closes after. Idempotent.
func (c *Comm) closeProxy() error {
	c.EndRequests(fmt.Errorf("%w: rank %d: the request's communicator was closed: the request has ended", halo.ErrState, c.cfg.Rank))
	if px := c.currentProxy(); px != nil {
		return px.Close()
	}
	return nil
}

// CloseProxy is closeProxy for a caller that closes the plans between it
// and Close (Close alone closes the proxy first, then the transport).
func (c *Comm) CloseProxy() error { return c.closeProxy() }

// abortProxy ends the queued stream-ordered exchanges before the
// communicator's abort, so that none begins on it.
func (c *Comm) abortProxy() {
	if px := c.currentProxy(); px != nil {
		px.Abort()
	}
}

// lose keeps err, a failure of freed request r's exchange, for the next
// exchange to report (the first one stays). A communicator closed, or one
// that failed (every later call says so), has nothing to add.
func (c *Comm) lose(r *Request, err error) {
	if err == nil {
		return
	}
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	c.loseLocked(r, err)
}

func (c *Comm) loseLocked(r *Request, err error) {
	if c.st.lost != nil || c.st.gone != nil {
		return
	}
	what, dir := "host", "forward"
	if r.stream != nil {
		what = "stream-ordered"
	}
	if r.dir == halo.DirBackward {
		dir = "backward"
	}
	c.st.lost = fmt.Errorf("rank %d: an earlier %s %s exchange, whose request was freed before its result was read, "+
		"failed, so what was read of its results (by a stream told to wait for it) is not valid: %w", c.cfg.Rank, what, dir, err)
}

// takeLost returns the lost failure once, after a look at the freed
// stream-ordered requests that have ended since the last.
func (c *Comm) takeLost() error {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	left := c.st.freedStreams[:0]
	for _, r := range c.st.freedStreams {
		if done, err := r.stream.Test(); !done {
			left = append(left, r)
		} else if err != nil {
			c.loseLocked(r, classed(err))
		}
	}
	clear(c.st.freedStreams[len(left):])
	c.st.freedStreams = left
	err := c.st.lost
	c.st.lost = nil
	return err
}

func (c *Comm) requestsGone() error {
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	return c.st.gone
}

// classed gives an error of the proxy or the driver a halo class: an abort
// is the communicator's failure, a CUDA error the transport's.
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

// end records the result of the exchange the first time it is known, and
// gives a host request's plan direction back to the plan's own calls.
func (r *Request) end(err error) error {
	if !r.ended {
		r.ended, r.err = true, err
		if r.stream == nil {
			r.c.st.mu.Lock()
			if o := r.c.st.owners[r.p]; o != nil && o[r.dir] == r {
				o[r.dir] = nil
			}
			r.c.st.mu.Unlock()
		}
	}
	return r.err
}

var errPlanGone = fmt.Errorf("%w: the request's plan was destroyed while its exchange was in flight", halo.ErrState)

// Test progresses the exchange without blocking; done once it has ended,
// with its error, on every call until the request is freed.
func (r *Request) Test() (done bool, err error) {
	done, err = r.poll()
	r.told = r.told || done
	return done, err
}

// Wait blocks until the exchange has ended and returns its result.
func (r *Request) Wait() error {
	err := r.wait()
	r.told = true
	return err
}

// poll is Test, without telling the caller.
func (r *Request) poll() (done bool, err error) {
	if gone := r.c.requestsGone(); gone != nil {
		return true, gone
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
	if r.planGone {
		return true, r.end(errPlanGone)
	}
	if !r.c.Quiet() {
		return false, nil
	}
	r.c.settleDetached(false)
	ok, err := r.p.Test(r.dir)
	if ok || err != nil {
		return true, r.end(err)
	}
	return false, nil
}

func (r *Request) wait() error {
	if gone := r.c.requestsGone(); gone != nil {
		return gone
	}
	if r.ended {
		return r.err
	}
	if r.stream != nil {
		return r.end(classed(r.stream.Wait()))
	}
	if r.planGone {
		return r.end(errPlanGone)
	}
	r.c.Quiesce()
	return r.end(r.p.Wait(r.dir))
}

// WaitOn makes the CUDA stream wait for a stream-ordered exchange, and
// returns at once; the exchange's error is then Test's or Wait's.
func (r *Request) WaitOn(stream uintptr) error {
	if gone := r.c.requestsGone(); gone != nil {
		return gone // never a stream wait on the freed flag
	}
	if r.stream == nil {
		return fmt.Errorf("%w: stream %#x: this request was started without a stream; wait for it on the host (stream NULL)", halo.ErrInvalid, stream)
	}
	return classed(r.stream.WaitOn(cuda.Stream(stream)))
}

// Stream reports whether the request is stream-ordered.
func (r *Request) Stream() bool { return r.stream != nil }

// Free releases the request, as ucp_request_free does: one whose exchange
// has not ended is released when it ends. A failure of an exchange whose
// result the caller was not told (by Test or Wait) is the next exchange's
// to report (lost). A stream-ordered exchange ends on the proxy; a host one
// is finished by the next call that blocks on the host (Quiesce), or
// progressed by another request's Test. The request is not used after Free.
func (r *Request) Free() error {
	if ok, err := r.poll(); ok {
		if !r.told && err != errPlanGone {
			r.c.lose(r, err) // ended, failed, and nobody was told
		}
		return nil // a stream-ordered request holds nothing more (its event went when the proxy had waited)
	}
	c := r.c
	c.st.mu.Lock()
	defer c.st.mu.Unlock()
	if r.stream == nil {
		c.st.detached = append(c.st.detached, r)
	} else if !r.told {
		c.st.freedStreams = append(c.st.freedStreams, r)
	}
	return nil
}
