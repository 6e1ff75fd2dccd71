package comm

// Liveness: how a rank learns within milliseconds that a peer's process has
// died, with no cost on the exchange.
//
// UCX does not tell: without peer error handling (off by default, because
// it costs single-copy large messages: bench/RESULTS.md) a dead peer's
// shared memory looks alive and a wait ends only at its deadline; with it,
// UCX's keepalive takes a second or more, and never ends a rendezvous send
// (ucx/NOTES.md). gloo is told in milliseconds because the kernel closes a
// dead process's sockets, SIGKILL included. So each pair of ranks holds one
// TCP connection of its own that carries nothing but a handshake and, on a
// graceful close, a goodbye byte: a reader blocked on it gets EOF or RST
// when the other process ends, and tells the transport (Transport.PeerGone),
// which fails that peer's operations in flight and later ones with
// PEER_FAILED naming it. No goroutine wakes and no byte moves while the
// ranks live, so the 2 KiB and 2 MiB exchanges are unchanged (measured:
// bench/RESULTS.md).
//
// Each rank listens on an ephemeral port from New, and its address envelope
// (address.go) carries the port, a random secret and where it can be
// reached; the lower rank of each pair dials the higher when it connects.
// That works the same for the rendezvous and for an external bootstrap (the
// caller exchanges the envelopes), and needs no rendezvous server after the
// start. Costs: one socket and one goroutine per peer (a full mesh; a CP
// group is tens of ranks).
//
// What it cannot see: a forked child inherits the sockets (close-on-exec is
// set, so an exec'd one does not), and a parent killed while such a child
// lives stays "alive" until the child exits; a host that loses power or its
// network sends no FIN: TCP keepalive (liveKeepAlive) finds it in seconds.
// Without a link (no listener could be opened, or no advertised address
// answered the dial) a dead peer is found at the deadline, as before.

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"
)

const (
	liveMagic = "HALV" // a dialer's hello: magic | listener's secret | dialer's rank u32
	liveAck   = 'A'    // the listener took the link
	liveBye   = 'B'    // a graceful close: the EOF that follows is no death
	// liveGrace is how long a reader waits between the EOF and telling the
	// transport, so that what the peer sent over UCX before it died (its
	// last exchange, on another socket or in shared memory) has landed.
	liveGrace = 50 * time.Millisecond
	// liveDialTimeout bounds one dial and one handshake.
	liveDialTimeout = 3 * time.Second
	maxLiveIPs      = 8
)

// liveKeepAlive finds a peer whose host died or became unreachable (no FIN
// comes): about Idle + Interval*Count.
var liveKeepAlive = net.KeepAliveConfig{Enable: true, Idle: 2 * time.Second, Interval: time.Second, Count: 5}

// liveEndpoint is what a rank's envelope says about its liveness listener.
type liveEndpoint struct {
	port   uint16
	secret [16]byte
	host   [16]byte // same value: same network stack, dial loopback
	ips    []net.IP // otherwise tried in order
}

// encode is the envelope's liveness section (address.go).
func (e liveEndpoint) encode() []byte {
	b := binary.BigEndian.AppendUint16(nil, e.port)
	b = append(b, e.secret[:]...)
	b = append(b, e.host[:]...)
	b = append(b, byte(len(e.ips)))
	for _, ip := range e.ips {
		if v4 := ip.To4(); v4 != nil {
			ip = v4
		}
		b = append(b, byte(len(ip)))
		b = append(b, ip...)
	}
	return b
}

var errLiveSection = errors.New("malformed liveness section")

func decodeLiveEndpoint(b []byte) (liveEndpoint, error) {
	var e liveEndpoint
	if len(b) < 2+16+16+1 {
		return e, errLiveSection
	}
	e.port = binary.BigEndian.Uint16(b)
	copy(e.secret[:], b[2:18])
	copy(e.host[:], b[18:34])
	n := int(b[34])
	b = b[35:]
	if n > maxLiveIPs {
		return e, errLiveSection
	}
	for range n {
		if len(b) < 1 || (b[0] != 4 && b[0] != 16) || len(b) < 1+int(b[0]) {
			return e, errLiveSection
		}
		e.ips = append(e.ips, net.IP(bytes.Clone(b[1:1+b[0]])))
		b = b[1+b[0]:]
	}
	if len(b) != 0 || e.port == 0 {
		return e, errLiveSection
	}
	return e, nil
}

// liveness is one rank's links to its peers.
type liveness struct {
	rank, size int
	own        liveEndpoint
	ln         net.Listener
	pid        int            // the creating process: only it says goodbye
	gone       func(peer int) // Transport.PeerGone

	mu     sync.Mutex
	links  []net.Conn // by peer rank; nil until made
	closed bool
}

// listenLiveness opens this rank's listener: on every interface when it can
// (peers may be on other hosts; the secret keeps strangers out), else on
// loopback. nil when neither works: the communicator then runs without.
func listenLiveness(rank, size int, gone func(int)) *liveness {
	if size < 2 {
		return nil
	}
	ln, err := net.Listen("tcp", ":0")
	wildcard := err == nil
	if err != nil {
		if ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return nil
		}
	}
	l := &liveness{rank: rank, size: size, ln: ln, pid: os.Getpid(), gone: gone, links: make([]net.Conn, size)}
	l.own.port = uint16(ln.Addr().(*net.TCPAddr).Port)
	rand.Read(l.own.secret[:])
	l.own.host = hostIdentity()
	if wildcard {
		l.own.ips = reachableIPs()
	}
	go l.accept()
	return l
}

// hostIdentity names this network stack: the boot and the network
// namespace (netns tests run "hosts" on one kernel). Random when unreadable,
// so that it matches nobody.
func hostIdentity() (id [16]byte) {
	boot, err1 := os.ReadFile("/proc/sys/kernel/random/boot_id")
	ns, err2 := os.Readlink("/proc/self/ns/net")
	if err1 != nil || err2 != nil {
		rand.Read(id[:])
		return id
	}
	h := sha256.Sum256([]byte("halo host\x00" + string(bytes.TrimSpace(boot)) + "\x00" + ns))
	copy(id[:], h[:])
	return id
}

// reachableIPs are this host's addresses that another host may reach, IPv4
// first (link-local ones need a zone and are left out).
func reachableIPs() []net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	var v4, v6 []net.IP
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok || n.IP.IsLoopback() || n.IP.IsLinkLocalUnicast() || n.IP.IsUnspecified() || n.IP.IsMulticast() {
			continue
		}
		if n.IP.To4() != nil {
			v4 = append(v4, n.IP)
		} else {
			v6 = append(v6, n.IP)
		}
	}
	ips := append(v4, v6...)
	return ips[:min(len(ips), maxLiveIPs)]
}

// endpoint is the section of this rank's envelope; empty without a listener.
func (l *liveness) endpoint() []byte {
	if l == nil {
		return nil
	}
	return l.own.encode()
}

// connect dials every higher rank that advertised a listener and waits for
// the handshakes, for at most liveConnectWait: an exchange this rank starts
// afterwards is covered, and a higher rank cannot finish an exchange with
// this one before this one has connected. (A rank that dies between its
// address and its connect is found by the rendezvous, or at the deadline.)
// A link that cannot be made only means that peer's death is found at the
// deadline.
func (l *liveness) connect(peers [][]byte) {
	if l == nil {
		return
	}
	var wg sync.WaitGroup
	for r := l.rank + 1; r < l.size; r++ {
		if len(peers[r]) == 0 {
			continue
		}
		e, err := decodeLiveEndpoint(peers[r])
		if err != nil {
			continue // checked when the envelope was opened
		}
		wg.Add(1)
		go l.dial(r, e, wg.Done)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	t := time.NewTimer(liveConnectWait)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
}

// liveConnectWait bounds how long Connect waits for the handshakes.
const liveConnectWait = 2 * time.Second

// dial makes the link to a higher rank. On the same host, a refused dial or
// a link closed before the ack means that the peer's process has ended
// (nothing else listens on its port but its successor there); across hosts
// an address may belong to another machine's network (a container bridge),
// so a failure there proves nothing and the next address is tried.
func (l *liveness) dial(peer int, e liveEndpoint, done func()) {
	defer done()
	local := e.host == l.own.host
	var hosts []string
	if local {
		hosts = []string{"127.0.0.1"}
	} else {
		for _, ip := range e.ips {
			hosts = append(hosts, ip.String())
		}
	}
	hello := append([]byte(liveMagic), e.secret[:]...)
	hello = binary.BigEndian.AppendUint32(hello, uint32(l.rank))
	d := net.Dialer{Timeout: liveDialTimeout, KeepAliveConfig: liveKeepAlive}
	for _, h := range hosts {
		conn, err := d.Dial("tcp", net.JoinHostPort(h, fmt.Sprint(e.port)))
		if err != nil {
			if local && errors.Is(err, syscall.ECONNREFUSED) {
				go l.died(peer)
			}
			continue
		}
		conn.SetDeadline(time.Now().Add(liveDialTimeout))
		var ack [1]byte
		if _, err := conn.Write(hello); err == nil {
			_, err = io.ReadFull(conn, ack[:])
		}
		if err != nil || ack[0] != liveAck {
			conn.Close()
			if local && err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				go l.died(peer)
			}
			continue
		}
		conn.SetDeadline(time.Time{})
		if l.adopt(peer, conn) {
			go l.watch(peer, conn)
		} else {
			conn.Close() // closed meanwhile
		}
		return
	}
}

func (l *liveness) accept() {
	for {
		conn, err := l.ln.Accept()
		if err != nil {
			return // closed
		}
		go l.handshake(conn)
	}
}

// handshake takes a link from a lower rank that knows this rank's secret.
func (l *liveness) handshake(conn net.Conn) {
	conn.SetDeadline(time.Now().Add(liveDialTimeout))
	var hello [len(liveMagic) + 16 + 4]byte
	if _, err := io.ReadFull(conn, hello[:]); err != nil ||
		string(hello[:4]) != liveMagic || !bytes.Equal(hello[4:20], l.own.secret[:]) {
		conn.Close()
		return
	}
	peer := int(binary.BigEndian.Uint32(hello[20:]))
	if peer < 0 || peer >= l.rank || !l.adopt(peer, conn) {
		conn.Close()
		return
	}
	if _, err := conn.Write([]byte{liveAck}); err != nil {
		return // its reader below sees the same
	}
	conn.SetDeadline(time.Time{})
	l.watch(peer, conn)
}

// adopt makes conn the link to peer, unless it has one or l is closed.
func (l *liveness) adopt(peer int, conn net.Conn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.links[peer] != nil {
		return false
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetKeepAliveConfig(liveKeepAlive)
	}
	l.links[peer] = conn
	return true
}

// watch blocks on the link until it ends; an end without a goodbye, while
// this rank has not closed, is the peer's death.
func (l *liveness) watch(peer int, conn net.Conn) {
	var b [1]byte
	bye := false
	for {
		if _, err := conn.Read(b[:]); err != nil {
			break
		}
		bye = bye || b[0] == liveBye
	}
	if !bye {
		l.died(peer)
	}
}

// died tells the transport, after liveGrace, unless this rank has closed.
func (l *liveness) died(peer int) {
	time.Sleep(liveGrace)
	l.mu.Lock()
	closed := l.closed
	l.mu.Unlock()
	if !closed {
		l.gone(peer)
	}
}

// close closes every link and the listener, saying goodbye first when bye
// is set (a communicator that did not fail: an aborted one's end is left to
// look like a death, in case its UCX goodbye, which says more, was lost) and
// this is the creating process (a forked child that closes its copy must not
// speak for its parent). Safe on nil and twice.
func (l *liveness) close(bye bool) {
	if l == nil {
		return
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	links := l.links
	l.mu.Unlock()
	l.ln.Close()
	own := bye && os.Getpid() == l.pid
	for _, c := range links {
		if c == nil {
			continue
		}
		if own {
			c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
			c.Write([]byte{liveBye})
		}
		c.Close()
	}
}
