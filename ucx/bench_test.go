package ucx

import (
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"
)

// pingSegs describes n bytes at off as segs equal segments with a gap of one
// segment between them (segs == 1: contiguous).
func pingSegs(off int64, n, segs int) []Segment {
	if segs <= 1 {
		return contig(off, int64(n))
	}
	l := int64(n / segs)
	out := make([]Segment, segs)
	for i := range out {
		out[i] = Segment{Off: off + int64(i)*2*l, Len: l}
	}
	return out
}

// pingPong runs iters round trips of n bytes between tr and peer; the lower
// rank starts each one. After 1000 warm-up round trips it times every round
// trip and reports one-way latencies (half a round trip, as ucx_perftest
// reports them): the median, which tells the steady rate from one disturbed
// by other load on the machine, the 99th percentile and the mean.
func pingPong(tr *Transport, peer, n, segs, iters int) (string, error) {
	buf, err := tr.Alloc(4*n + 4096)
	if err != nil {
		return "", err
	}
	defer buf.Free()
	recv, send := pingSegs(0, n, segs), pingSegs(int64(2*n), n, segs)
	initiator := tr.Rank() < peer
	var batches []*Batch
	if initiator {
		b, err := tr.Prepare([]Op{{Peer: peer, Tag: 2, Segs: recv}, {Peer: peer, Tag: 1, Send: true, Segs: send}})
		if err != nil {
			return "", err
		}
		batches = []*Batch{b}
	} else {
		r, err := tr.Prepare([]Op{{Peer: peer, Tag: 1, Segs: recv}})
		if err != nil {
			return "", err
		}
		s, err := tr.Prepare([]Op{{Peer: peer, Tag: 2, Send: true, Segs: send}})
		if err != nil {
			return "", err
		}
		batches = []*Batch{r, s}
	}
	bases := []uintptr{buf.Addr()}
	round := func() error {
		for _, b := range batches {
			if err := b.Post(bases, 0); err != nil {
				return err
			}
			if err := b.Wait(time.Now().Add(60 * time.Second)); err != nil {
				return err
			}
		}
		return nil
	}
	for i := 0; i < 1000; i++ {
		if err := round(); err != nil {
			return "", err
		}
	}
	samples := make([]time.Duration, iters)
	start := time.Now()
	for i := range samples {
		t0 := time.Now()
		if err := round(); err != nil {
			return "", err
		}
		samples[i] = time.Since(t0) / 2
	}
	mean := time.Since(start) / time.Duration(2*iters)
	slices.Sort(samples)
	median, p99 := samples[len(samples)/2], samples[len(samples)*99/100]
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	return fmt.Sprintf("%d bytes x%d segs: one-way median %.3f us (%.2f GB/s), p99 %.3f us, mean %.3f us (%.2f GB/s)",
		n, segs, us(median), float64(n)/float64(median.Nanoseconds()), us(p99), us(mean), float64(n)/float64(mean.Nanoseconds())), nil
}

// benchPingPong measures round trips between two transports of this
// process, each driven by its own goroutine (and so, on two cores, its own
// core): the setting of ucx_perftest -t tag_lat over shared memory.
func benchPingPong(b *testing.B, n, segs int, opts Options) {
	a, c := openPair(b, opts)
	abuf, cbuf := alloc(b, a, 4*n+4096), alloc(b, c, 4*n+4096)
	recv, send := pingSegs(0, n, segs), pingSegs(int64(2*n), n, segs)
	ping := prepare(b, a, []Op{{Peer: 1, Tag: 2, Segs: recv}, {Peer: 1, Tag: 1, Send: true, Segs: send}})
	pongRecv := prepare(b, c, []Op{{Peer: 0, Tag: 1, Segs: recv}})
	pongSend := prepare(b, c, []Op{{Peer: 0, Tag: 2, Send: true, Segs: send}})

	const warmup = 1000
	total := warmup + b.N
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		bases := []uintptr{cbuf.Addr()}
		for i := 0; i < total; i++ {
			for _, p := range []*Batch{pongRecv, pongSend} {
				if err := p.Post(bases, 0); err != nil {
					errc <- err
					return
				}
				if err := p.Wait(time.Now().Add(30 * time.Second)); err != nil {
					errc <- err
					return
				}
			}
		}
		errc <- nil
	}()

	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	bases := []uintptr{abuf.Addr()}
	round := func() {
		if err := ping.Post(bases, 0); err != nil {
			b.Fatal(err)
		}
		if err := ping.Wait(time.Now().Add(30 * time.Second)); err != nil {
			b.Fatal(err)
		}
	}
	for i := 0; i < warmup; i++ {
		round()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		round()
	}
	b.StopTimer()
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	oneWay := float64(b.Elapsed().Nanoseconds()) / float64(2*b.N)
	b.ReportMetric(oneWay/1e3, "us/one-way")
	b.ReportMetric(float64(n)/oneWay, "GB/s")
}

func BenchmarkPingPong2KiB(b *testing.B)       { benchPingPong(b, 2048, 1, Options{}) }
func BenchmarkPingPong2KiBIOV16(b *testing.B)  { benchPingPong(b, 2048, 16, Options{}) }
func BenchmarkPingPong2MiB(b *testing.B)       { benchPingPong(b, 2<<20, 1, Options{}) }
func BenchmarkPingPong2MiBIOV64(b *testing.B)  { benchPingPong(b, 2<<20, 64, Options{}) }
func BenchmarkPingPong8B(b *testing.B)         { benchPingPong(b, 8, 1, Options{}) }
func BenchmarkPingPong2KiBNoPeer(b *testing.B) { benchPingPong(b, 2048, 1, Options{}) }

// Post and Wait allocate nothing in Go.
func TestPostWaitNoAllocs(t *testing.T) {
	a, c := openPair(t, testOptions())
	abuf, cbuf := alloc(t, a, 8192), alloc(t, c, 8192)
	ab := prepare(t, a, []Op{{Peer: 1, Tag: 1, Send: true, Segs: pingSegs(0, 2048, 4)}, {Peer: 1, Tag: 2, Segs: contig(4096, 2048)}})
	cb := prepare(t, c, []Op{{Peer: 0, Tag: 2, Send: true, Segs: contig(0, 2048)}, {Peer: 0, Tag: 1, Segs: pingSegs(4096, 2048, 4)}})
	const runs = 200
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		bases := []uintptr{cbuf.Addr()}
		for i := 0; i < runs+1; i++ { // AllocsPerRun runs once more to warm up
			if err := cb.Post(bases, 0); err != nil {
				done <- err
				return
			}
			if err := cb.Wait(time.Now().Add(10 * time.Second)); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	bases := []uintptr{abuf.Addr()}
	var err error
	allocs := testing.AllocsPerRun(runs, func() {
		if err == nil {
			err = ab.Post(bases, 0)
		}
		if err == nil {
			err = ab.Wait(time.Now().Add(10 * time.Second))
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if allocs != 0 {
		t.Fatalf("%v allocations per Post+Wait", allocs)
	}
}

// stream sends iters windows of window messages of n bytes from the lower
// rank to the higher one, each window one batch on either side, and reports
// the bandwidth: the setting of ucx_perftest -t tag_bw.
func stream(tr *Transport, peer, n, segs, window, iters int) (string, error) {
	buf, err := tr.Alloc(2*n + 4096)
	if err != nil {
		return "", err
	}
	defer buf.Free()
	sender := tr.Rank() < peer
	ops := make([]Op, window)
	for i := range ops {
		ops[i] = Op{Peer: peer, Tag: uint64(i), Send: sender, Segs: pingSegs(0, n, segs)}
	}
	b, err := tr.Prepare(ops)
	if err != nil {
		return "", err
	}
	defer b.Close()
	bases := []uintptr{buf.Addr()}
	var start time.Time
	const warmup = 10
	for i := 0; i < warmup+iters; i++ {
		if i == warmup {
			start = time.Now()
		}
		if err := b.Post(bases, 0); err != nil {
			return "", err
		}
		if err := b.Wait(time.Now().Add(60 * time.Second)); err != nil {
			return "", err
		}
	}
	elapsed := time.Since(start)
	perMsg := elapsed / time.Duration(window*iters)
	return fmt.Sprintf("stream %d bytes x%d segs, window %d: %.3f us per message, %.2f GB/s",
		n, segs, window, float64(perMsg.Nanoseconds())/1e3, float64(n)/float64(perMsg.Nanoseconds())), nil
}

func benchStream(b *testing.B, n, segs, window int, opts Options) {
	a, c := openPair(b, opts)
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		_, err := stream(c, 0, n, segs, window, b.N)
		errc <- err
	}()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.ResetTimer()
	res, err := stream(a, 1, n, segs, window, b.N)
	b.StopTimer()
	if err != nil {
		b.Fatal(err)
	}
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(n * window))
	b.Log(res)
}

// BenchmarkStream2MiB: eight 2 MiB messages per batch, one way; compare
// with ucx_perftest -t tag_bw -s 2097152.
func BenchmarkStream2MiB(b *testing.B) { benchStream(b, 2<<20, 1, 8, Options{}) }
