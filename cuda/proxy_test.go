package cuda

import (
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The proxy's contract on the host emulation: the exchange begins after the
// work queued before Start, later work on the stream (and on a stream told
// to WaitOn) runs after it, Start does not wait, and a failed exchange
// still releases the streams.
func TestProxyOrdersOnStreams(t *testing.T) {
	h := NewHostFake()
	p, err := NewProxy(h)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const s, s2 = Stream(7), Stream(8)
	var log []string
	var step atomic.Int32
	gate := make(chan struct{})
	h.Enqueue(s, func() { <-gate; log = append(log, "producer"); step.Add(1) })
	t0 := time.Now()
	r, err := p.Start(s, func() error { log = append(log, "exchange"); step.Add(1); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(t0); d > 100*time.Millisecond {
		t.Errorf("Start blocked the caller for %v", d)
	}
	h.Enqueue(s, func() { log = append(log, "consumer") })
	if err := r.WaitOn(s2); err != nil {
		t.Fatal(err)
	}
	var sawOnS2 int32
	h.Enqueue(s2, func() { sawOnS2 = step.Load() })
	if done, _ := r.Test(); done {
		t.Fatal("the exchange ended before the work queued before it")
	}
	if err := r.Free(); !errors.Is(err, ErrNotDone) {
		t.Fatalf("Free of an unfinished request: %v, want ErrNotDone", err)
	}
	close(gate)
	if err := r.Wait(); err != nil {
		t.Fatal(err)
	}
	h.Synchronize(s)
	h.Synchronize(s2)
	if want := []string{"producer", "exchange", "consumer"}; len(log) != 3 || log[0] != want[0] || log[1] != want[1] || log[2] != want[2] {
		t.Errorf("order on the stream %v, want %v", log, want)
	}
	if sawOnS2 != 2 {
		t.Errorf("work on the other stream ran after %d of 2 steps", sawOnS2)
	}
	if err := r.Free(); err != nil {
		t.Fatal(err)
	}

	boom := errors.New("peer gone")
	r2, err := p.Start(s, func() error { return boom })
	if err != nil {
		t.Fatal(err)
	}
	if err := r2.Wait(); !errors.Is(err, boom) {
		t.Fatalf("Wait: %v, want %v", err, boom)
	}
	if err := h.Synchronize(s); err != nil { // would hang if the flag stayed unwritten
		t.Fatal(err)
	}
	if _, err := p.Start(0, func() error { return nil }); err == nil {
		t.Error("Start on stream 0 was accepted")
	}
}

// Where there is no CUDA driver, loading it fails naming the library.
func TestLoadWithoutDriverNamesIt(t *testing.T) {
	if _, err := os.Stat("/dev/nvidiactl"); err == nil {
		t.Skip("this machine has an NVIDIA driver")
	}
	_, err := Load("cuda")
	if err == nil {
		t.Fatal("Load succeeded with no GPU")
	}
	t.Log(err)
	if want := "libcuda.so.1"; !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not name %s", err, want)
	}
}

// Abort ends a job whose stream never reaches it, and releases the streams
// waiting for it; Close then returns.
func TestProxyAbortEndsAStuckWait(t *testing.T) {
	h := NewHostFake()
	p, err := NewProxy(h)
	if err != nil {
		t.Fatal(err)
	}
	const s = Stream(3)
	never := make(chan struct{})
	h.Enqueue(s, func() { <-never })
	r, err := p.Start(s, func() error { t.Error("the exchange ran"); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if err := r.WaitOn(Stream(4)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	p.Abort()
	if err := r.Wait(); !errors.Is(err, ErrAborted) {
		t.Fatalf("Wait after Abort: %v, want ErrAborted", err)
	}
	h.Synchronize(Stream(4)) // released: the flag was written
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	close(never)
}

// The count of exchanges wraps around: a stream waiting for the first one
// after the wrap still waits, then goes.
func TestProxyFlagWrapsAround(t *testing.T) {
	h := NewHostFake()
	p, err := NewProxy(h)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.seq = 1<<32 - 1 // the next exchange is number 0
	p.flag.Set(1<<32 - 1)
	gate := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(gate) }) }
	defer open() // before Close, which waits for the job, on any failure
	r, err := p.Start(9, func() error { <-gate; return nil })
	if err != nil {
		t.Fatal(err)
	}
	var after atomic.Bool
	h.Enqueue(9, func() { after.Store(true) })
	time.Sleep(5 * time.Millisecond)
	if after.Load() {
		t.Fatal("the stream went on before the exchange numbered 0 ended")
	}
	open()
	if err := r.Wait(); err != nil {
		t.Fatal(err)
	}
	h.Synchronize(9)
	if !after.Load() {
		t.Fatal("the stream did not go on")
	}
}

// Thousands of exchanges queued on one stream, then on several, before any
// wait: the host emulation's stream holds 1024 operations (two per start),
// so Start blocks in the driver until the proxy has run the earlier ones.
// With the driver called under the lock the proxy needs, about 512 starts
// deadlocked for ever.
func TestProxyManyQueued(t *testing.T) {
	h := NewHostFake()
	p, err := NewProxy(h)
	if err != nil {
		t.Fatal(err)
	}
	for _, streams := range []int{1, 4} {
		const n = 3000
		var ran atomic.Int32
		done := make(chan []*Request, 1)
		go func() {
			var rs []*Request
			for i := 0; i < n; i++ {
				r, err := p.Start(Stream(20+i%streams), func() error { ran.Add(1); return nil })
				if err != nil {
					t.Error(err)
					break
				}
				rs = append(rs, r)
			}
			done <- rs
		}()
		select {
		case rs := <-done:
			for _, r := range rs {
				if err := r.Wait(); err != nil {
					t.Fatal(err)
				}
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%d streams: the starts hung after %d of %d exchanges ran", streams, ran.Load(), n)
		}
		if ran.Load() != n {
			t.Fatalf("%d of %d exchanges ran", ran.Load(), n)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

// An exchange in flight holds the stream (its peer is silent) while starts
// behind it fill the stream until one blocks in the driver; Abort (and the
// communicator's abort ending the exchange in flight) must end that start,
// end every queued job with ErrAborted, and write their flags so that the
// stream drains; a later start is refused at once.
func TestProxyAbortEndsABlockedStart(t *testing.T) {
	h := NewHostFake()
	p, err := NewProxy(h)
	if err != nil {
		t.Fatal(err)
	}
	const s = Stream(30)
	stuck := make(chan struct{})
	first, err := p.Start(s, func() error { <-stuck; return errors.New("aborted in flight") })
	if err != nil {
		t.Fatal(err)
	}
	var started atomic.Int32
	done := make(chan []*Request, 1)
	go func() {
		var rs []*Request
		for i := 0; i < 3000; i++ {
			r, err := p.Start(s, func() error { t.Error("a queued exchange ran after the abort"); return nil })
			if err != nil {
				if !errors.Is(err, ErrAborted) {
					t.Errorf("start after the abort: %v, want ErrAborted", err)
				}
				continue
			}
			started.Add(1)
			rs = append(rs, r)
		}
		done <- rs
	}()
	for deadline := time.Now().Add(5 * time.Second); started.Load() < 500 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // blocked in the driver by now
	if n := started.Load(); n >= 3000 {
		t.Fatalf("all %d starts returned with the stream held: the test does not fill the stream", n)
	}
	t0 := time.Now()
	p.Abort()
	close(stuck)
	var rs []*Request
	select {
	case rs = <-done:
	case <-time.After(2 * time.Second):
		t.Fatalf("the abort did not end the blocked start (%d started)", started.Load())
	}
	for _, r := range rs {
		if err := r.Wait(); !errors.Is(err, ErrAborted) {
			t.Fatalf("a queued exchange after the abort: %v, want ErrAborted", err)
		}
	}
	if err := first.Wait(); err == nil {
		t.Fatal("the exchange in flight succeeded")
	}
	drained := make(chan error, 1)
	go func() { drained <- h.Synchronize(s) }()
	select {
	case err := <-drained:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("the stream did not drain after the abort: a flag was left unwritten")
	}
	if d := time.Since(t0); d > time.Second {
		t.Errorf("the abort took %v", d)
	}
	t.Logf("%d starts queued before the abort, all ended %v after it", len(rs), time.Since(t0))
	if _, err := p.Start(s, func() error { return nil }); !errors.Is(err, ErrAborted) {
		t.Errorf("start after the abort: %v, want ErrAborted", err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}
