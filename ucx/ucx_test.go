package ucx

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// testOptions keeps tests on this machine's shared memory with peer error
// handling on, so that peer failures are reported as they happen.
func testOptions() Options {
	return Options{PeerErrorHandling: true}
}

// openPair opens two transports in this process, ranks 0 and 1 of one
// group, connected to each other; they are closed when the test ends.
func openPair(tb testing.TB, opts Options) (*Transport, *Transport) {
	tb.Helper()
	a, err := Open(0, 2, opts)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { a.Close() })
	b, err := Open(1, 2, opts)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	addrs := [][]byte{a.Address(), b.Address()}
	if err := a.Connect(addrs); err != nil {
		tb.Fatal(err)
	}
	if err := b.Connect(addrs); err != nil {
		tb.Fatal(err)
	}
	return a, b
}

func alloc(tb testing.TB, t *Transport, n int) *Buffer {
	tb.Helper()
	buf, err := t.Alloc(n)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { buf.Free() })
	return buf
}

func prepare(tb testing.TB, t *Transport, ops []Op) *Batch {
	tb.Helper()
	b, err := t.Prepare(ops)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return b
}

// run posts and waits for each batch on its own goroutine, as two processes
// would, and returns their Wait errors.
func run(deadline time.Duration, batches []*Batch, bases [][]uintptr) []error {
	errs := make([]error, len(batches))
	var wg sync.WaitGroup
	for i := range batches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if err := batches[i].Post(bases[i], 0); err != nil {
				errs[i] = err
				return
			}
			errs[i] = batches[i].Wait(time.Now().Add(deadline))
		}()
	}
	wg.Wait()
	return errs
}

func fill(b []byte, seed byte) {
	for i := range b {
		b[i] = seed + byte(i*7) + byte(i>>8)
	}
}

func contig(off, n int64) []Segment { return []Segment{{Off: off, Len: n}} }

func TestVersion(t *testing.T) {
	v := Version()
	if v == "" || !strings.Contains(v, ".") {
		t.Fatalf("Version() = %q", v)
	}
	t.Logf("UCX %s", v)
}

func TestOpenArgs(t *testing.T) {
	for _, c := range [][2]int{{-1, 2}, {2, 2}, {0, 0}} {
		if tr, err := Open(c[0], c[1], Options{}); err == nil {
			tr.Close()
			t.Errorf("Open(%d, %d) succeeded", c[0], c[1])
		}
	}
}

func TestContiguous(t *testing.T) {
	a, b := openPair(t, testOptions())
	abuf, bbuf := alloc(t, a, 8192), alloc(t, b, 8192)
	fill(abuf.Bytes()[:2048], 1)
	fill(bbuf.Bytes()[:4096], 2)

	// a sends 2 KiB at offset 0 and receives 4 KiB at 4096; b the reverse.
	ab := prepare(t, a, []Op{
		{Peer: 1, Tag: 1, Send: true, Segs: contig(0, 2048)},
		{Peer: 1, Tag: 2, Segs: contig(4096, 4096)},
	})
	bb := prepare(t, b, []Op{
		{Peer: 0, Tag: 2, Send: true, Segs: contig(0, 4096)},
		{Peer: 0, Tag: 1, Segs: contig(4096, 2048)},
	})
	for iter := 0; iter < 3; iter++ {
		for _, err := range run(5*time.Second, []*Batch{ab, bb}, [][]uintptr{{abuf.Addr()}, {bbuf.Addr()}}) {
			if err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(abuf.Bytes()[4096:8192], bbuf.Bytes()[:4096]) {
			t.Fatal("a received wrong data")
		}
		if !bytes.Equal(bbuf.Bytes()[4096:6144], abuf.Bytes()[:2048]) {
			t.Fatal("b received wrong data")
		}
	}
}

func TestIOV(t *testing.T) {
	a, b := openPair(t, testOptions())
	for _, segLen := range []int64{128, 4096, 64 << 10} {
		t.Run(fmt.Sprint(segLen), func(t *testing.T) {
			const nseg = 16
			stride := 2 * segLen
			src := alloc(t, a, int(nseg*stride))
			dst := alloc(t, b, int(nseg*stride+segLen))
			fill(src.Bytes(), 3)

			// Every other segLen-byte slab of src, into dst as 4 larger
			// segments in reverse order of address, through two more bases
			// that point into dst differently (one message, several tensors).
			var sendSegs, recvSegs []Segment
			for i := int64(0); i < nseg; i++ {
				sendSegs = append(sendSegs, Segment{Off: i * stride, Len: segLen})
			}
			quarter := nseg * segLen / 4
			for i := int64(3); i >= 0; i-- {
				if i%2 == 0 {
					recvSegs = append(recvSegs, Segment{Base: 1, Off: i * quarter, Len: quarter})
				} else {
					recvSegs = append(recvSegs, Segment{Base: 2, Off: segLen + i*quarter, Len: quarter})
				}
			}
			sb := prepare(t, a, []Op{{Peer: 1, Tag: 5, Send: true, Segs: sendSegs}})
			rb := prepare(t, b, []Op{{Peer: 0, Tag: 5, Segs: recvSegs}})
			for _, err := range run(5*time.Second, []*Batch{sb, rb}, [][]uintptr{{src.Addr()}, {0, dst.Addr() + uintptr(segLen), dst.Addr()}}) {
				if err != nil {
					t.Fatal(err)
				}
			}
			var want []byte
			for _, s := range sendSegs {
				want = append(want, src.Bytes()[s.Off:s.Off+s.Len]...)
			}
			var got []byte
			for _, s := range recvSegs {
				at := s.Off // base 2 is dst itself, base 1 dst+segLen
				if s.Base == 1 {
					at += segLen
				}
				got = append(got, dst.Bytes()[at:at+s.Len]...)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("IOV data mismatch")
			}
		})
	}
}

func TestManyOps(t *testing.T) {
	a, b := openPair(t, testOptions())
	const n = 64
	sizes := func(i int) int64 { return []int64{0, 1, 8, 2048, 9000, 70000, 1 << 20}[i%7] }
	var total int64
	for i := 0; i < n; i++ {
		total += sizes(i)
	}
	abuf, bbuf := alloc(t, a, int(2*total)), alloc(t, b, int(2*total))
	fill(abuf.Bytes()[:total], 4)
	fill(bbuf.Bytes()[:total], 5)

	// Each side sends n messages from the first half of its buffer and
	// receives n into the second half; odd messages as two segments,
	// received as a contiguous range.
	var aops, bops []Op
	var off int64
	for i := 0; i < n; i++ {
		sz := sizes(i)
		send := contig(off, sz)
		if i%2 == 1 && sz > 1 {
			send = []Segment{{Off: off, Len: sz / 2}, {Off: off + sz/2, Len: sz - sz/2}}
		}
		recv := contig(total+off, sz)
		aops = append(aops, Op{Peer: 1, Tag: uint64(100 + i), Send: true, Segs: send}, Op{Peer: 1, Tag: uint64(1000 + i), Segs: recv})
		bops = append(bops, Op{Peer: 0, Tag: uint64(1000 + i), Send: true, Segs: send}, Op{Peer: 0, Tag: uint64(100 + i), Segs: recv})
		off += sz
	}
	ab, bb := prepare(t, a, aops), prepare(t, b, bops)
	for iter := 0; iter < 3; iter++ {
		for _, err := range run(20*time.Second, []*Batch{ab, bb}, [][]uintptr{{abuf.Addr()}, {bbuf.Addr()}}) {
			if err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(abuf.Bytes()[total:], bbuf.Bytes()[:total]) || !bytes.Equal(bbuf.Bytes()[total:], abuf.Bytes()[:total]) {
			t.Fatal("data mismatch")
		}
	}
}

// Two batches with different tags, sent in one order and received in the
// other, each complete with their own data.
func TestTagSeparation(t *testing.T) {
	a, b := openPair(t, testOptions())
	for _, size := range []int64{2048, 256 << 10} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			src, dst := alloc(t, a, int(2*size)), alloc(t, b, int(2*size))
			fill(src.Bytes()[:size], 6)
			fill(src.Bytes()[size:], 7)
			send1 := prepare(t, a, []Op{{Peer: 1, Tag: 1, Send: true, Segs: contig(0, size)}})
			send2 := prepare(t, a, []Op{{Peer: 1, Tag: 2, Send: true, Segs: contig(size, size)}})
			recv1 := prepare(t, b, []Op{{Peer: 0, Tag: 1, Segs: contig(0, size)}})
			recv2 := prepare(t, b, []Op{{Peer: 0, Tag: 2, Segs: contig(size, size)}})

			errc := make(chan error, 1)
			go func() {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				deadline := time.Now().Add(10 * time.Second)
				for _, s := range []*Batch{send2, send1} {
					if err := s.Post([]uintptr{src.Addr()}, 0); err != nil {
						errc <- err
						return
					}
				}
				for _, s := range []*Batch{send2, send1} {
					if err := s.Wait(deadline); err != nil {
						errc <- err
						return
					}
				}
				errc <- nil
			}()
			deadline := time.Now().Add(10 * time.Second)
			for _, r := range []*Batch{recv1, recv2} {
				if err := r.Post([]uintptr{dst.Addr()}, 0); err != nil {
					t.Fatal(err)
				}
			}
			for _, r := range []*Batch{recv2, recv1} {
				if err := r.Wait(deadline); err != nil {
					t.Fatal(err)
				}
			}
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst.Bytes(), src.Bytes()) {
				t.Fatal("tags crossed")
			}
		})
	}
}

// A receive matches only its own peer, even when another rank sends the
// same tag.
func TestSenderSeparation(t *testing.T) {
	opts := testOptions()
	var ts [3]*Transport
	for r := range ts {
		tr, err := Open(r, 3, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		ts[r] = tr
	}
	addrs := [][]byte{ts[0].Address(), ts[1].Address(), ts[2].Address()}
	for _, tr := range ts {
		if err := tr.Connect(addrs); err != nil {
			t.Fatal(err)
		}
	}
	if got := ts[0].TagBits(); got != 62 {
		t.Fatalf("TagBits = %d, want 62", got)
	}
	bufs := [3]*Buffer{alloc(t, ts[0], 64), alloc(t, ts[1], 64), alloc(t, ts[2], 64)}
	fill(bufs[1].Bytes(), 11)
	fill(bufs[2].Bytes(), 22)
	// Rank 0 receives tag 9 from rank 2 into [0,32) and from rank 1 into
	// [32,64), the opposite order of ranks.
	r0 := prepare(t, ts[0], []Op{{Peer: 2, Tag: 9, Segs: contig(0, 32)}, {Peer: 1, Tag: 9, Segs: contig(32, 32)}})
	s1 := prepare(t, ts[1], []Op{{Peer: 0, Tag: 9, Send: true, Segs: contig(0, 32)}})
	s2 := prepare(t, ts[2], []Op{{Peer: 0, Tag: 9, Send: true, Segs: contig(0, 32)}})
	for _, err := range run(5*time.Second, []*Batch{s1, s2, r0}, [][]uintptr{{bufs[1].Addr()}, {bufs[2].Addr()}, {bufs[0].Addr()}}) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(bufs[0].Bytes()[:32], bufs[2].Bytes()[:32]) || !bytes.Equal(bufs[0].Bytes()[32:], bufs[1].Bytes()[:32]) {
		t.Fatal("receive matched the wrong sender")
	}

	if _, err := ts[0].Prepare([]Op{{Peer: 1, Tag: 1 << 62}}); err == nil {
		t.Fatal("Prepare accepted a tag that overlaps the rank bits")
	}
	if _, err := ts[0].Prepare([]Op{{Peer: 0, Tag: 1}}); err == nil {
		t.Fatal("Prepare accepted an op to this rank")
	}
}

func TestLengthMismatch(t *testing.T) {
	a, b := openPair(t, testOptions())
	cases := []struct {
		name       string
		sent, want int64
		iov        bool
		late       bool // post the receive after the message has arrived
	}{
		{"short", 1024, 2048, false, false},
		{"long", 4096, 2048, false, false},
		{"short-iov", 1024, 2048, true, false},
		{"long-iov", 4096, 2048, true, false},
		{"short-unexpected", 1024, 2048, false, true},
		{"long-unexpected", 4096, 2048, false, true},
		{"short-rndv", 256 << 10, 512 << 10, false, false},
		{"long-rndv", 512 << 10, 256 << 10, false, false},
		{"empty", 0, 2048, false, false},
	}
	src, dst := alloc(t, a, 1<<20), alloc(t, b, 1<<20)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tag := uint64(0x4200 + i)
			recvSegs := contig(0, c.want)
			if c.iov {
				recvSegs = []Segment{{Off: 0, Len: c.want / 2}, {Off: c.want, Len: c.want - c.want/2}}
			}
			sb := prepare(t, a, []Op{{Peer: 1, Tag: tag, Send: true, Segs: contig(0, c.sent)}})
			rb := prepare(t, b, []Op{{Peer: 0, Tag: tag, Segs: recvSegs}})
			var errs []error
			if c.late {
				done := make(chan error)
				go func() {
					runtime.LockOSThread()
					defer runtime.UnlockOSThread()
					err := sb.Post([]uintptr{src.Addr()}, 0)
					if err == nil {
						err = sb.Wait(time.Now().Add(5 * time.Second))
					}
					done <- err
				}()
				sendErr := <-done // eager: complete before the receive exists
				time.Sleep(10 * time.Millisecond)
				errs = append(run(5*time.Second, []*Batch{rb}, [][]uintptr{{dst.Addr()}}), sendErr)
			} else {
				errs = run(5*time.Second, []*Batch{rb, sb}, [][]uintptr{{dst.Addr()}, {src.Addr()}})
			}
			if errs[1] != nil {
				t.Fatalf("send: %v", errs[1])
			}
			err := errs[0]
			if !errors.Is(err, ErrMessageLength) {
				t.Fatalf("receive: got %v, want ErrMessageLength", err)
			}
			var le *LengthError
			if !errors.As(err, &le) || le.Expected != c.want || le.Got != c.sent {
				t.Fatalf("LengthError = %+v, want expected %d got %d", le, c.want, c.sent)
			}
			want := fmt.Sprintf("recv from rank 0 (tag %#x, %d bytes): received %d bytes, expected %d", tag, c.want, c.sent, c.want)
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("error %q does not contain %q", err, want)
			}
		})
	}
}

// A loose receive takes the peer's next message that agrees on its Match
// bits, of any length (a longer one cut, its sender still completing), and
// Received reports the sender's tag and length: how an exchange hears a
// peer that runs another plan without waiting for a message never sent.
func TestLooseReceive(t *testing.T) {
	a, b := openPair(t, testOptions())
	const match = 0xfffff
	cases := []struct {
		name       string
		sent, want int64
	}{
		{"empty-into-eager", 0, 2048},
		{"eager-longer", 4096, 2048},
		{"rndv-into-empty", 512 << 10, 0},
		{"rndv-shorter", 256 << 10, 512 << 10},
		{"same", 2048, 2048},
	}
	src, dst := alloc(t, a, 1<<20), alloc(t, b, 1<<20)
	fill(src.Bytes(), 3)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			seq := uint64(0x100 + i)
			sentTag := uint64(0xabc)<<24 | 2<<20 | seq
			sb := prepare(t, a, []Op{{Peer: 1, Tag: sentTag &^ match, Send: true, Segs: contig(0, c.sent)}})
			rb := prepare(t, b, []Op{{Peer: 0, Tag: 0x5<<24 | 3<<20, Match: match, Segs: contig(0, c.want)}})
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for k, bt := range []*Batch{rb, sb} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					runtime.LockOSThread()
					defer runtime.UnlockOSThread()
					base := []uintptr{dst.Addr(), src.Addr()}[k]
					if errs[k] = bt.Post([]uintptr{base}, seq); errs[k] == nil {
						errs[k] = bt.Wait(time.Now().Add(5 * time.Second))
					}
				}()
			}
			wg.Wait()
			if errs[0] != nil || errs[1] != nil {
				t.Fatalf("receive: %v; send: %v", errs[0], errs[1])
			}
			tag, n := rb.Received(0)
			if tag != sentTag || n != c.sent {
				t.Fatalf("Received = %#x, %d; want %#x, %d", tag, n, sentTag, c.sent)
			}
			// What a longer message leaves in the buffer is unspecified.
			if c.sent <= c.want && !bytes.Equal(dst.Bytes()[:c.sent], src.Bytes()[:c.sent]) {
				t.Fatal("data differs")
			}
		})
	}
}

func TestDeadline(t *testing.T) {
	a, _ := openPair(t, testOptions())
	buf := alloc(t, a, 4096)
	rb := prepare(t, a, []Op{
		{Peer: 1, Tag: 0x77, Segs: contig(0, 2048)},
		{Peer: 1, Tag: 0x78, Segs: []Segment{{Off: 0, Len: 1024}, {Off: 2048, Len: 1024}}},
	})
	for iter := 0; iter < 2; iter++ {
		const d = 200 * time.Millisecond
		if err := rb.Post([]uintptr{buf.Addr()}, 0); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err := rb.Wait(start.Add(d))
		elapsed := time.Since(start)
		if !errors.Is(err, ErrTimeout) {
			t.Fatalf("Wait: %v, want ErrTimeout", err)
		}
		if elapsed < d || elapsed > d+3*time.Second { // slack for a loaded machine (a Wait that ignored d would hang)
			t.Fatalf("Wait returned after %v, deadline %v", elapsed, d)
		}
		for _, want := range []string{
			"2 of 2 operations failed",
			"recv from rank 1 (tag 0x77, 2048 bytes): deadline passed",
			"recv from rank 1 (tag 0x78, 2048 bytes): deadline passed",
		} {
			if !strings.Contains(err.Error(), want) {
				t.Fatalf("error %q does not contain %q", err, want)
			}
		}
		var we *WaitError
		if !errors.As(err, &we) || len(we.Ops) != 2 || we.Ops[0].Peer != 1 {
			t.Fatalf("WaitError = %+v", we)
		}
	}
}

// A send nobody receives: after the deadline its endpoint is force-closed
// so that UCX lets go of the buffer, later operations to that peer fail at
// once, and Close still works.
func TestDeadlinePendingSend(t *testing.T) {
	a, _ := openPair(t, testOptions())
	buf := alloc(t, a, 4<<20)
	sb := prepare(t, a, []Op{{Peer: 1, Tag: 3, Send: true, Segs: contig(0, 4<<20)}})
	if err := sb.Post([]uintptr{buf.Addr()}, 0); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err := sb.Wait(start.Add(200 * time.Millisecond))
	if elapsed := time.Since(start); elapsed > 4*time.Second { // 200 ms, and slack for a loaded machine
		t.Fatalf("Wait took %v", elapsed)
	}
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "send to rank 1 (tag 0x3, 4194304 bytes)") {
		t.Fatalf("Wait: %v", err)
	}
	buf.Free() // UCX must not touch it any more

	if err := sb.Post([]uintptr{buf.Addr()}, 0); err != nil {
		t.Fatal(err)
	}
	err = sb.Wait(time.Now().Add(time.Second))
	if !errors.Is(err, ErrPeerFailed) || !strings.Contains(err.Error(), "rank 1 was closed") {
		t.Fatalf("Wait after force close: %v", err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestClose(t *testing.T) {
	a, b := openPair(t, testOptions())
	buf := alloc(t, a, 4096)
	ab := prepare(t, a, []Op{{Peer: 1, Tag: 1, Segs: contig(0, 2048)}})
	posted := prepare(t, b, []Op{{Peer: 0, Tag: 1, Segs: contig(0, 2048)}})
	bbuf := alloc(t, b, 4096)
	if err := posted.Post([]uintptr{bbuf.Addr()}, 0); err != nil {
		t.Fatal(err)
	}

	for i := 0; i < 2; i++ {
		if err := a.Close(); err != nil {
			t.Fatalf("Close #%d: %v", i+1, err)
		}
	}
	if err := ab.Post([]uintptr{buf.Addr()}, 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("Post after Close: %v", err)
	}
	if err := ab.Wait(time.Now().Add(time.Second)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Wait after Close: %v", err)
	}
	if _, err := a.Prepare(nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Prepare after Close: %v", err)
	}
	if err := a.Connect(nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Connect after Close: %v", err)
	}
	if err := ab.Close(); err != nil {
		t.Fatal(err)
	}
	// Closing with a posted batch aborts it.
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := posted.Wait(time.Now()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Wait on a batch of a closed transport: %v", err)
	}
	// Buffers outlive their transport.
	fill(buf.Bytes(), 1)
	if err := buf.Free(); err != nil || buf.Free() != nil || buf.Bytes() != nil {
		t.Fatal("Free")
	}
}

func TestBatchClose(t *testing.T) {
	a, _ := openPair(t, testOptions())
	buf := alloc(t, a, 4096)
	ab := prepare(t, a, []Op{{Peer: 1, Tag: 1, Segs: contig(0, 2048)}})
	if err := ab.Post([]uintptr{buf.Addr()}, 0); err != nil {
		t.Fatal(err)
	}
	if err := ab.Post([]uintptr{buf.Addr()}, 0); err == nil {
		t.Fatal("second Post without Wait succeeded")
	}
	for i := 0; i < 2; i++ {
		if err := ab.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if err := ab.Post([]uintptr{buf.Addr()}, 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("Post after batch Close: %v", err)
	}
}

func TestNotConnected(t *testing.T) {
	a, err := Open(0, 2, testOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	ab, err := a.Prepare([]Op{{Peer: 1, Tag: 1, Segs: contig(0, 8)}})
	if err != nil {
		t.Fatal(err)
	}
	buf := alloc(t, a, 8)
	if err := ab.Post([]uintptr{buf.Addr()}, 0); !errors.Is(err, errNotConnected) {
		t.Fatalf("Post before Connect: %v", err)
	}
	if err := a.Connect([][]byte{a.Address()}); err == nil {
		t.Fatal("Connect with too few addresses succeeded")
	}
	if err := a.Connect([][]byte{a.Address(), nil}); err == nil || !strings.Contains(err.Error(), "rank 1") {
		t.Fatalf("Connect without rank 1's address: %v", err)
	}
}

type node struct{ next *node }

// UCX's error-signal handlers must not take nil-pointer panics from Go.
func TestNilPanicRecoveredAfterOpen(t *testing.T) {
	a, _ := openPair(t, testOptions())
	_ = a
	var n *node
	recovered := func() (r any) {
		defer func() { r = recover() }()
		return n.next
	}()
	err, ok := recovered.(runtime.Error)
	if !ok || !strings.Contains(err.Error(), "nil pointer dereference") {
		t.Fatalf("recovered %v, want a nil pointer dereference", recovered)
	}
}

func TestStatusError(t *testing.T) {
	err := error(&StatusError{Func: "ucp_tag_send_nbx", Status: StatusEndpointTimeout})
	if !errors.Is(err, ErrPeerFailed) || errors.Is(err, ErrTimeout) {
		t.Fatalf("%v: wrong sentinel", err)
	}
	if !strings.Contains(err.Error(), "Endpoint timeout") {
		t.Fatalf("%q lacks UCX's text", err)
	}
	if !errors.Is(&StatusError{Status: StatusMessageTruncated}, ErrMessageLength) {
		t.Fatal("truncated is not ErrMessageLength")
	}
}

// Peer error handling must not cost shared memory (UCX 1.13 drops posix and
// sysv from such endpoints unless their ERROR_HANDLING option is set).
func TestPeerModeKeepsSharedMemory(t *testing.T) {
	for _, opts := range []Options{{}, {PeerErrorHandling: true}} {
		a, _ := openPair(t, opts)
		info, err := a.EndpointInfo(1)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(info, "sysv/") && !strings.Contains(info, "posix/") {
			t.Errorf("peer error handling %v: no shared memory lane:\n%s", opts.PeerErrorHandling, info)
		}
	}
}

func TestStatusValues(t *testing.T) {
	for s, text := range map[Status]string{
		StatusOK:               "Success",
		StatusMessageTruncated: "Message truncated",
		StatusCanceled:         "Request canceled",
		StatusTimedOut:         "Operation timed out",
		StatusConnectionReset:  "Connection reset by remote peer",
		StatusEndpointTimeout:  "Endpoint timeout",
	} {
		if s.String() != text {
			t.Errorf("Status(%d).String() = %q, want %q", int32(s), s.String(), text)
		}
	}
}

// A wait for a peer that is still computing sleeps on the worker's event
// fd once it has been idle for SleepAfter, instead of holding a CPU; the
// message still arrives and the abort still wakes it (TestAbortWakesWait).
func TestLongWaitSleeps(t *testing.T) {
	for _, opts := range []Options{{}, {SleepAfter: -1}} {
		a, b := openPair(t, opts)
		if opts.SleepAfter == 0 && !b.Sleeps() {
			t.Skip("this UCX gives the worker no event fd")
		}
		src, dst := alloc(t, a, 64), alloc(t, b, 64)
		send := prepare(t, a, []Op{{Peer: 1, Tag: 9, Send: true, Segs: contig(0, 64)}})
		recv := prepare(t, b, []Op{{Peer: 0, Tag: 9, Segs: contig(0, 64)}})
		if err := recv.Post([]uintptr{dst.Addr()}, 0); err != nil {
			t.Fatal(err)
		}
		go func() {
			time.Sleep(200 * time.Millisecond)
			send.Post([]uintptr{src.Addr()}, 0)
			send.Wait(time.Now().Add(5 * time.Second))
		}()
		wall, cpu := time.Now(), cpuTime()
		if err := recv.Wait(time.Now().Add(5 * time.Second)); err != nil {
			t.Fatal(err)
		}
		w, c := time.Since(wall), cpuTime()-cpu
		t.Logf("SleepAfter %v: a %v wait used %v of CPU", opts.SleepAfter, w.Round(time.Millisecond), c.Round(100*time.Microsecond))
		if opts.SleepAfter == 0 && c > w/2 {
			t.Errorf("a %v wait used %v of CPU: it did not sleep", w, c)
		}
	}
}

// Abort wakes a wait that sleeps, from another goroutine, within the grace.
func TestAbortWakesWait(t *testing.T) {
	_, b := openPair(t, Options{})
	dst := alloc(t, b, 64)
	recv := prepare(t, b, []Op{{Peer: 0, Tag: 9, Segs: contig(0, 64)}})
	if err := recv.Post([]uintptr{dst.Addr()}, 0); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(100 * time.Millisecond) // long enough for the wait to sleep
		b.Abort()
	}()
	start := time.Now()
	err := recv.Wait(time.Now().Add(30 * time.Second))
	if !errors.Is(err, ErrAborted) {
		t.Fatalf("got %v, want ErrAborted", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("the aborted wait returned after %v", d)
	}
	if err := recv.Post([]uintptr{dst.Addr()}, 0); !errors.Is(err, ErrAborted) {
		t.Fatalf("post after abort: %v", err)
	}
	if !b.Aborted() {
		t.Fatal("Aborted() is false")
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// PeerGone (a peer's liveness link closed) ends a sleeping wait at once: a
// receive from that peer and a rendezvous send to it, which no force close
// completes, fail naming the peer; later posts to it fail at once.
func TestPeerGoneEndsWait(t *testing.T) {
	a, b := openPair(t, Options{})
	const n = 1 << 20 // rendezvous, not eager
	src, dst := alloc(t, b, n), alloc(t, b, 64)
	ops := prepare(t, b, []Op{{Peer: 0, Tag: 9, Segs: contig(0, 64)}, {Peer: 0, Tag: 10, Send: true, Segs: []Segment{{Base: 1, Len: n}}}})
	if err := ops.Post([]uintptr{dst.Addr(), src.Addr()}, 0); err != nil {
		t.Fatal(err)
	}
	_ = a // rank 0 never receives: only the liveness news ends the wait
	go func() {
		time.Sleep(100 * time.Millisecond) // long enough for the wait to sleep
		b.PeerGone(0)
	}()
	start := time.Now()
	err := ops.Wait(time.Now().Add(30 * time.Second))
	var pe *PeerError
	if !errors.As(err, &pe) || pe.Rank != 0 || pe.Status != StatusPeerGone {
		t.Fatalf("got %v, want a PeerError of rank 0, StatusPeerGone", err)
	}
	var we *WaitError
	if !errors.As(err, &we) || len(we.Ops) != 2 {
		t.Fatalf("got %v, want both operations failed", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("the wait returned after %v", d)
	}
	t.Logf("after %v: %v", time.Since(start), err)
}
