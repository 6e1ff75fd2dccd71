package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy runs stream-ordered exchanges of one communicator, one at a time in
// the order they were started, on one OS thread of its own (NCCL's network
// proxy): the caller's thread only records an event and queues a stream wait,
// then returns.
type Proxy struct {
	drv Driver
	// flag counts the exchanges ended: the n-th started is waited for as
	// flag >= n, compared as the driver does, (int32_t)(flag - n) >= 0, so
	// that the count may wrap around. One word for all, so that no stream
	// ever waits on memory that was freed (a request's own flag could not
	// be freed while some stream told to wait on it had not reached the
	// wait yet).
	flag *Flag
	seq  uint32 // exchanges started
	// starting serialises Start, so that the sequence numbers reach every
	// stream in the order of the queue. It is held across the driver calls,
	// which block while a stream's queue is full; the proxy thread never
	// takes it, so it can always go on popping jobs, and the stream drains.
	starting sync.Mutex
	// mu guards the queue; no driver call runs under it.
	mu   sync.Mutex
	cond *sync.Cond
	jobs []*Request
	busy bool // a job is running
	stop bool
	// aborted: jobs not yet begun end at once with ErrAborted (their
	// flags written, so that no stream waits forever), and new starts are
	// refused; abortCh is closed alike, to wake a wait for a job's start.
	aborted   atomic.Bool
	abortCh   chan struct{}
	abortOnce sync.Once
}

// Request is one exchange started on a stream.
type Request struct {
	proxy *Proxy
	ctx   uintptr
	ev    Event
	seq   uint32
	run   func() error
	// ready is closed once Start's driver calls have returned, with
	// startErr their error: the job is queued before them (under mu), and
	// the proxy must not wait on an event not yet recorded.
	ready    chan struct{}
	startErr error
	done     chan struct{}
	err      error
}

// ErrNotDone is returned by Free for a request whose exchange has not ended.
var ErrNotDone = errors.New("the exchange has not ended")

// ErrAborted ends the jobs that had not begun when the proxy was aborted.
var ErrAborted = errors.New("the communicator was aborted before this stream-ordered exchange began")

func NewProxy(drv Driver) (*Proxy, error) {
	f, err := drv.FlagAlloc()
	if err != nil {
		return nil, err
	}
	p := &Proxy{drv: drv, flag: f, abortCh: make(chan struct{})}
	p.cond = sync.NewCond(&p.mu)
	go p.loop()
	return p, nil
}

// Start orders run on stream s: it begins once the work queued on s so far
// has run, and later work on s waits until it has returned (whatever it
// returned: a failed exchange must not hang the stream). After Abort it is
// refused with ErrAborted; a start that a full stream blocks in the driver
// returns once the abort has drained the stream.
func (p *Proxy) Start(s Stream, run func() error) (*Request, error) {
	if s == 0 {
		return nil, fmt.Errorf("stream 0 is not a stream (CUDA's default stream is CU_STREAM_LEGACY, 0x1)")
	}
	if p.aborted.Load() {
		return nil, ErrAborted
	}
	ctx, err := p.drv.CurrentContext()
	if err != nil {
		return nil, err
	}
	r := &Request{proxy: p, ctx: ctx, run: run, ready: make(chan struct{}), done: make(chan struct{})}
	if r.ev, err = p.drv.EventCreate(); err != nil {
		return nil, err
	}
	p.starting.Lock()
	defer p.starting.Unlock()
	// The number is taken and the job queued first, the driver called
	// after, outside mu: while the driver blocks on a full stream, the
	// proxy runs the jobs ahead, whose flags let the stream go on.
	p.mu.Lock()
	switch {
	case p.stop:
		err = fmt.Errorf("the communicator's proxy is closed")
	case p.aborted.Load():
		err = ErrAborted
	}
	if err != nil {
		p.mu.Unlock()
		p.drv.EventDestroy(r.ev)
		return nil, err
	}
	p.seq++
	r.seq = p.seq
	p.jobs = append(p.jobs, r)
	p.cond.Broadcast()
	p.mu.Unlock()

	if err = p.drv.EventRecord(r.ev, s); err == nil {
		err = p.drv.StreamWaitFlag(s, p.flag, r.seq)
	}
	// The stream wait may have been queued even so: the job still ends
	// (as a no-op), so that the flag passes r.seq.
	r.startErr = err
	close(r.ready)
	if err != nil {
		return nil, err
	}
	return r, nil
}

func (p *Proxy) loop() {
	runtime.LockOSThread() // the driver's current context is per thread
	var ctx uintptr
	for {
		p.mu.Lock()
		for len(p.jobs) == 0 && !p.stop {
			p.cond.Wait()
		}
		if len(p.jobs) == 0 {
			p.mu.Unlock()
			return
		}
		r := p.jobs[0]
		p.jobs = p.jobs[1:]
		p.busy = true
		p.mu.Unlock()

		ready := true
		select {
		case <-r.ready:
		case <-p.abortCh:
			select {
			case <-r.ready:
			default:
				ready = false // its Start is still in the driver
			}
		}
		err := ErrAborted
		if ready {
			err = r.startErr
			if err == nil && r.ctx != ctx {
				if err = p.drv.SetContext(r.ctx); err == nil {
					ctx = r.ctx
				}
			}
			if err == nil {
				err = p.waitEvent(r.ev)
			}
			if err == nil && p.aborted.Load() {
				err = ErrAborted
			}
			if err == nil {
				err = r.run()
			}
		}
		r.err = err
		p.flag.Set(r.seq)
		close(r.done)
		// The event goes once Start has recorded it; with the flag
		// written, the stream drains and Start's driver calls return.
		<-r.ready
		p.drv.EventDestroy(r.ev)

		p.mu.Lock()
		p.busy = false
		p.cond.Broadcast()
		p.mu.Unlock()
	}
}

// waitEvent waits for the work queued before the exchange, polling so that
// Abort can end the wait: spinning first (the stream is usually there
// already, or about to be), then sleeping in steps up to 50 µs.
func (p *Proxy) waitEvent(ev Event) error {
	nap := time.Microsecond
	for spins := 0; ; spins++ {
		if p.aborted.Load() {
			return ErrAborted
		}
		done, err := p.drv.EventQuery(ev)
		if err != nil || done {
			return err
		}
		if spins < 1000 {
			runtime.Gosched()
			continue
		}
		time.Sleep(nap)
		nap = min(2*nap, 50*time.Microsecond)
	}
}

// Abort ends the jobs queued and not yet begun with ErrAborted, now and
// from now on, and refuses later starts; the one running ends when its
// exchange does (the communicator's abort ends that). Safe from any thread.
func (p *Proxy) Abort() {
	p.aborted.Store(true)
	p.abortOnce.Do(func() { close(p.abortCh) })
}

// Idle waits until no job is queued or running.
func (p *Proxy) Idle() {
	p.mu.Lock()
	for len(p.jobs) > 0 || p.busy {
		p.cond.Wait()
	}
	p.mu.Unlock()
}

// Quiet reports whether no job is queued or running (Idle would return at once).
func (p *Proxy) Quiet() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.jobs) == 0 && !p.busy
}

// Close waits for the queued jobs and ends the proxy's thread. The flag is
// freed (cuMemFreeHost waits for the device). Idempotent.
func (p *Proxy) Close() error {
	p.Idle()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stop {
		return nil
	}
	p.stop = true
	p.cond.Broadcast()
	return p.drv.FlagFree(p.flag)
}

// Test reports whether the exchange has ended, and its error once it has.
func (r *Request) Test() (bool, error) {
	select {
	case <-r.done:
		return true, r.err
	default:
		return false, nil
	}
}

// Wait blocks the calling thread until the exchange has ended.
func (r *Request) Wait() error {
	<-r.done
	return r.err
}

// WaitOn makes stream s wait for the exchange; the host does not wait.
func (r *Request) WaitOn(s Stream) error {
	if s == 0 {
		return fmt.Errorf("stream 0 is not a stream (CUDA's default stream is CU_STREAM_LEGACY, 0x1)")
	}
	return r.proxy.drv.StreamWaitFlag(s, r.proxy.flag, r.seq)
}

// Free forgets the request once its exchange has ended; it holds nothing
// else (its event went when the proxy had waited on it).
func (r *Request) Free() error {
	if done, _ := r.Test(); !done {
		return ErrNotDone
	}
	return nil
}
