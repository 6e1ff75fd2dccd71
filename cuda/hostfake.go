package cuda

import (
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// HostFake emulates the driver on the host, so that the proxy's logic runs
// where there is no GPU (HALO_CUDA_DRIVER=host-fake): a stream is a FIFO of
// operations run in order by a goroutine of its own, created on first use
// for any non-zero handle; events complete when their stream reaches them;
// flags are host words. It lives in the library, not in a test package,
// because the C and Python tests drive it through libhalo.
type HostFake struct {
	mu      sync.Mutex
	streams map[Stream]chan func()
	events  map[Event]chan struct{}
	next    Event
}

func NewHostFake() *HostFake {
	return &HostFake{streams: map[Stream]chan func(){}, events: map[Event]chan struct{}{}, next: 1}
}

func (h *HostFake) Name() string                     { return "host-fake" }
func (h *HostFake) CurrentContext() (uintptr, error) { return 0, nil }
func (h *HostFake) SetContext(uintptr) error         { return nil }

// Enqueue appends op to stream s, as a kernel launch would.
func (h *HostFake) Enqueue(s Stream, op func()) error {
	if s == 0 {
		return fmt.Errorf("host-fake: stream 0 is not a stream")
	}
	h.mu.Lock()
	q, ok := h.streams[s]
	if !ok {
		q = make(chan func(), 1024)
		h.streams[s] = q
		go func() {
			for op := range q {
				op()
			}
		}()
	}
	h.mu.Unlock()
	q <- op
	return nil
}

// Synchronize returns once everything queued on s before it has run.
func (h *HostFake) Synchronize(s Stream) error {
	done := make(chan struct{})
	if err := h.Enqueue(s, func() { close(done) }); err != nil {
		return err
	}
	<-done
	return nil
}

func (h *HostFake) EventCreate() (Event, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	ev := h.next
	h.next++
	h.events[ev] = make(chan struct{})
	return ev, nil
}

func (h *HostFake) event(ev Event) (chan struct{}, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	c, ok := h.events[ev]
	if !ok {
		return nil, fmt.Errorf("host-fake: event %d does not exist", ev)
	}
	return c, nil
}

// EventRecord supports one record per event, which is all the proxy does.
func (h *HostFake) EventRecord(ev Event, s Stream) error {
	c, err := h.event(ev)
	if err != nil {
		return err
	}
	return h.Enqueue(s, func() { close(c) })
}

func (h *HostFake) EventQuery(ev Event) (bool, error) {
	c, err := h.event(ev)
	if err != nil {
		return false, err
	}
	select {
	case <-c:
		return true, nil
	default:
		return false, nil
	}
}

func (h *HostFake) EventDestroy(ev Event) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.events, ev)
	return nil
}

func (h *HostFake) FlagAlloc() (*Flag, error) {
	w := new(uint32)
	return &Flag{host: unsafe.Pointer(w), dev: uint64(uintptr(unsafe.Pointer(w)))}, nil
}

func (h *HostFake) FlagFree(*Flag) error { return nil }

// StreamWaitFlag holds the stream as cuStreamWaitValue32 with
// CU_STREAM_WAIT_VALUE_GEQ does, polling: until (int32_t)(*flag - v) >= 0,
// a comparison that survives the counter's wrap-around.
func (h *HostFake) StreamWaitFlag(s Stream, f *Flag, v uint32) error {
	return h.Enqueue(s, func() {
		for spins := 0; int32(f.Get()-v) < 0; spins++ {
			if spins < 100 {
				runtime.Gosched()
			} else {
				time.Sleep(20 * time.Microsecond)
			}
		}
	})
}
