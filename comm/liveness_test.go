package comm

import (
	"net"
	"strconv"
	"sync"
	"testing"
	"time"
)

// goneLog records what a liveness reported.
type goneLog struct {
	mu    sync.Mutex
	peers []int
	ch    chan int
}

func newGoneLog() *goneLog { return &goneLog{ch: make(chan int, 8)} }

func (g *goneLog) gone(peer int) {
	g.mu.Lock()
	g.peers = append(g.peers, peer)
	g.mu.Unlock()
	g.ch <- peer
}

func (g *goneLog) expectNone(t *testing.T, who string, within time.Duration) {
	t.Helper()
	select {
	case p := <-g.ch:
		t.Errorf("%s: reported rank %d gone", who, p)
	case <-time.After(within):
	}
}

func (g *goneLog) expect(t *testing.T, who string, peer int, within time.Duration) {
	t.Helper()
	select {
	case p := <-g.ch:
		if p != peer {
			t.Errorf("%s: reported rank %d gone, want %d", who, p, peer)
		}
	case <-time.After(within):
		t.Errorf("%s: rank %d not reported gone within %v", who, peer, within)
	}
}

// pair links two ranks in one process, as Connect does.
func pair(t *testing.T) (l0, l1 *liveness, g0, g1 *goneLog) {
	g0, g1 = newGoneLog(), newGoneLog()
	l0, l1 = listenLiveness(0, 2, g0.gone), listenLiveness(1, 2, g1.gone)
	if l0 == nil || l1 == nil {
		t.Fatal("no liveness listener")
	}
	l0.connect([][]byte{nil, l1.endpoint()})
	deadline := time.Now().Add(2 * time.Second)
	for {
		l1.mu.Lock()
		ok := l1.links[0] != nil
		l1.mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("rank 1 never took rank 0's link")
		}
		time.Sleep(time.Millisecond)
	}
	return l0, l1, g0, g1
}

func TestLivenessEndpointRoundTrip(t *testing.T) {
	e := liveEndpoint{port: 4242, ips: []net.IP{net.ParseIP("198.18.0.1"), net.ParseIP("2001:db8::1")}}
	e.secret[0], e.host[15] = 7, 9
	got, err := decodeLiveEndpoint(e.encode())
	if err != nil || got.port != e.port || got.secret != e.secret || got.host != e.host || len(got.ips) != 2 ||
		!got.ips[0].Equal(e.ips[0]) || !got.ips[1].Equal(e.ips[1]) {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	b := e.encode()
	for n := range len(b) {
		if _, err := decodeLiveEndpoint(b[:n]); err == nil {
			t.Errorf("truncated to %d bytes: accepted", n)
		}
	}
	if _, err := decodeLiveEndpoint(append(b, 0)); err == nil {
		t.Error("a trailing byte: accepted")
	}
}

// A graceful close says goodbye first: the end of the link is no death.
func TestLivenessCloseIsNoDeath(t *testing.T) {
	l0, l1, g0, g1 := pair(t)
	l1.close(true)
	g0.expectNone(t, "rank 0", 300*time.Millisecond)
	l0.close(true)
	g1.expectNone(t, "rank 1", 100*time.Millisecond)
}

// A link that ends without a goodbye (the kernel closing a dead process's
// socket) reports the peer within liveGrace.
func TestLivenessDeathReported(t *testing.T) {
	l0, l1, g0, _ := pair(t)
	defer l0.close(true)
	l1.mu.Lock()
	l1.closed = true // as the process would be: nothing of it runs on
	conn := l1.links[0]
	l1.mu.Unlock()
	l1.ln.Close()
	start := time.Now()
	conn.Close()
	g0.expect(t, "rank 0", 1, time.Second)
	t.Logf("reported after %v", time.Since(start))
}

// A peer on this host whose listener is gone when the link is dialled (it
// died between handing out its address and this rank's connect) is reported.
func TestLivenessRefusedIsDeath(t *testing.T) {
	g0, g1 := newGoneLog(), newGoneLog()
	l0, l1 := listenLiveness(0, 2, g0.gone), listenLiveness(1, 2, g1.gone)
	defer l0.close(true)
	ep := l1.endpoint()
	l1.mu.Lock()
	l1.closed = true
	l1.mu.Unlock()
	l1.ln.Close()
	l0.connect([][]byte{nil, ep})
	g0.expect(t, "rank 0", 1, time.Second)
}

// A stranger who does not know the secret gets no link and kills nobody.
func TestLivenessStrangerRefused(t *testing.T) {
	l0, l1, g0, g1 := pair(t)
	defer l0.close(true)
	defer l1.close(true)
	e, _ := decodeLiveEndpoint(l1.endpoint())
	conn, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(e.port))))
	if err != nil {
		t.Fatal(err)
	}
	conn.Write(append([]byte(liveMagic), make([]byte, 20)...))
	conn.SetReadDeadline(time.Now().Add(time.Second))
	var b [1]byte
	if n, _ := conn.Read(b[:]); n != 0 {
		t.Errorf("the stranger got %q", b[:n])
	}
	conn.Close()
	g0.expectNone(t, "rank 0", 200*time.Millisecond)
	g1.expectNone(t, "rank 1", 10*time.Millisecond)
}
