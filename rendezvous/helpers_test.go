package rendezvous

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

const testToken = "test-token"

// logBuffer collects a server's JSON log lines for assertions.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// waitFor polls until the log has a line containing every one of parts.
func (l *logBuffer) waitFor(t *testing.T, parts ...string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		for _, line := range strings.Split(l.String(), "\n") {
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(line, p)
			}
			if ok {
				return
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no log line with %q in:\n%s", parts, l.String())
}

// startServer serves cfg on an ephemeral loopback port and shuts the server
// down when the test ends.
func startServer(t *testing.T, cfg ServerConfig) (*Server, string, *logBuffer) {
	t.Helper()
	return startServerWith(t, cfg, false)
}

// tinyBuffers makes the server's sockets small, so that a test can fill
// them with a megabyte or two instead of whatever the kernel autotunes to.
type tinyBuffers struct{ net.Listener }

func (l tinyBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if tcp, ok := c.(*net.TCPConn); ok {
		tcp.SetReadBuffer(16 << 10)
		tcp.SetWriteBuffer(16 << 10)
	}
	return c, err
}

func startServerWith(t *testing.T, cfg ServerConfig, tiny bool) (*Server, string, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	cfg.Logger = zerolog.New(logs).Level(zerolog.DebugLevel).With().Timestamp().Logger()
	if cfg.Token == "" && !cfg.Insecure {
		cfg.Token = testToken
	}
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if tiny {
		l = tinyBuffers{l}
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := s.Shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-served; !errors.Is(err, ErrServerClosed) {
			t.Errorf("serve returned %v", err)
		}
	})
	return s, l.Addr().String(), logs
}

func payloadFor(job, attempt string, rank int) []byte {
	// A few hundred bytes, like a UCX worker address.
	return []byte(fmt.Sprintf("%s/%s/%d/", job, attempt, rank) + strings.Repeat("x", 200+rank))
}

type result struct {
	values [][]byte
	err    error
	took   time.Duration
}

// runRanks runs Allgather for the given ranks of cfg's job concurrently.
func runRanks(cfg ClientConfig, ranks []int) map[int]result {
	var mu sync.Mutex
	var wg sync.WaitGroup
	out := make(map[int]result)
	for _, r := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := cfg
			c.Rank = r
			start := time.Now()
			v, err := Allgather(context.Background(), c, payloadFor(cfg.Job, cfg.Attempt, r))
			mu.Lock()
			out[r] = result{v, err, time.Since(start)}
			mu.Unlock()
		}()
	}
	wg.Wait()
	return out
}

func allRanks(n int) []int {
	r := make([]int, n)
	for i := range r {
		r[i] = i
	}
	return r
}

func checkGathered(t *testing.T, cfg ClientConfig, res map[int]result) {
	t.Helper()
	for r, got := range res {
		if got.err != nil {
			t.Errorf("job %s rank %d: %v", cfg.Job, r, got.err)
			continue
		}
		if len(got.values) != cfg.Size {
			t.Errorf("job %s rank %d: %d values, want %d", cfg.Job, r, len(got.values), cfg.Size)
			continue
		}
		for i, v := range got.values {
			if want := payloadFor(cfg.Job, cfg.Attempt, i); !bytes.Equal(v, want) {
				t.Errorf("job %s rank %d: value %d = %.40q, want %.40q", cfg.Job, r, i, v, want)
			}
		}
	}
}

// rawConn speaks the protocol by hand, to misbehave on purpose.
type rawConn struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func dialRaw(t *testing.T, addr string) *rawConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{t: t, c: c, br: bufio.NewReader(c)}
}

func (r *rawConn) sendBytes(b []byte) {
	r.t.Helper()
	if _, err := r.c.Write(b); err != nil {
		r.t.Fatal(err)
	}
}

func (r *rawConn) send(m Message) { r.t.Helper(); r.sendBytes(AppendFrame(nil, m)) }

func (r *rawConn) recv() (Message, error) {
	r.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	body, err := ReadFrame(r.br, MaxFrameBytes)
	if err != nil {
		return nil, err
	}
	return Decode(body)
}

func (r *rawConn) expect(want MsgType) Message {
	r.t.Helper()
	m, err := r.recv()
	if err != nil {
		r.t.Fatalf("waiting for %s: %v", want, err)
	}
	if m.Type() != want {
		r.t.Fatalf("got %#v, want %s", m, want)
	}
	return m
}

func (r *rawConn) expectError(code Code) *ErrorReply {
	r.t.Helper()
	e := r.expect(TypeError).(*ErrorReply)
	if e.Code != code {
		r.t.Fatalf("error %s (%q), want %s", e.Code, e.Message, code)
	}
	return e
}

// expectClosed waits for the server to close the connection.
func (r *rawConn) expectClosed() {
	r.t.Helper()
	r.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, r.br); err != nil {
		r.t.Fatalf("connection not closed by the server: %v", err)
	}
}

func (r *rawConn) hello(job, attempt string, rank, size int) {
	r.t.Helper()
	r.send(&Hello{Version: ProtocolVersion, Token: testToken, Job: job, Attempt: attempt, Rank: uint32(rank), Size: uint32(size)})
	r.expect(TypeAck)
}

func jobCount(s *Server) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.jobs)
}

// eventually polls cond for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
