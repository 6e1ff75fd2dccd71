package rendezvous

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"
)

func TestAllgather(t *testing.T) {
	t.Parallel()
	s, addr, _ := startServer(t, ServerConfig{})
	for w := 1; w <= 8; w++ {
		t.Run(fmt.Sprint("W=", w), func(t *testing.T) {
			cfg := ClientConfig{Addr: addr, Token: testToken, Job: fmt.Sprint("w", w), Attempt: "1", Size: w, Timeout: 10 * time.Second}
			checkGathered(t, cfg, runRanks(cfg, allRanks(w)))
		})
	}
	// Every job was complete and its ranks hung up, so the server forgot them all.
	eventually(t, "every job forgotten", func() bool { return jobCount(s) == 0 })
}

func TestLargeJob(t *testing.T) {
	t.Parallel()
	_, addr, _ := startServer(t, ServerConfig{})
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "large", Size: 128, Timeout: 15 * time.Second}
	checkGathered(t, cfg, runRanks(cfg, allRanks(cfg.Size)))
}

func TestManyJobsOnOneServer(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServer(t, ServerConfig{})
	done := make(chan struct{})
	const jobs = 6
	for j := range jobs {
		go func() {
			defer func() { done <- struct{}{} }()
			// Same job id, different attempts, must stay apart as well
			// as different job ids.
			cfg := ClientConfig{Addr: addr, Token: testToken, Job: fmt.Sprint("job", j%3), Attempt: fmt.Sprint(j / 3), Size: 2 + j%4, Timeout: 10 * time.Second}
			checkGathered(t, cfg, runRanks(cfg, allRanks(cfg.Size)))
		}()
	}
	for range jobs {
		<-done
	}
	logs.waitFor(t, `"message":"job complete"`, `"job":"job2"`, `"attempt":"1"`)
}

func TestWrongToken(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServer(t, ServerConfig{})
	start := time.Now()
	_, err := Allgather(context.Background(), ClientConfig{Addr: addr, Token: "guess", Job: "train", Attempt: "1", Size: 1, Timeout: 10 * time.Second}, []byte("x"))
	if !errors.Is(err, CodeUnauthorized) || !strings.Contains(err.Error(), "rejected the token") {
		t.Fatalf("err = %v, want a rejected token", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("rejection took %s: a bad token must not be retried", took)
	}
	logs.waitFor(t, `"level":"warn"`, `"job":"train"`, "rejecting client: bad token", `"remote":"127.0.0.1:`)

	// An empty token is no better.
	_, err = Allgather(context.Background(), ClientConfig{Addr: addr, Job: "train", Size: 1, Timeout: 10 * time.Second}, []byte("x"))
	if !errors.Is(err, CodeUnauthorized) {
		t.Fatalf("empty token: err = %v", err)
	}
}

// Misbehaving connections are dropped one by one, with a reason, while a
// job on the same server goes on.
func TestBadClientsDoNotDisturbOthers(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServerWith(t, ServerConfig{MaxMessageBytes: 4096}, true)
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "good", Attempt: "1", Size: 3, Timeout: 10 * time.Second}
	results := make(chan map[int]result, 1)
	// Ranks 0 and 1 arrive and wait; rank 2 only after the abuse.
	go func() { results <- runRanks(cfg, []int{0, 1}) }()
	eventually(t, "ranks 0 and 1 to wait", func() bool {
		return strings.Count(logs.String(), `"message":"client joined"`) >= 2
	})

	// An HTTP request: its first four bytes announce a huge frame.
	http := dialRaw(t, addr)
	http.sendBytes([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
	http.expectError(CodeTooLarge)
	http.expectClosed()

	// Random garbage in a well-formed frame.
	garbage := dialRaw(t, addr)
	garbage.sendBytes(AppendFrame(nil, &Ack{})[:4])
	garbage.sendBytes([]byte{0x55})
	garbage.expectError(CodeBadRequest)
	garbage.expectClosed()

	// A hello without the magic.
	noMagic := dialRaw(t, addr)
	noMagic.sendBytes([]byte{0, 0, 0, 8, byte(TypeHello), 'H', 'T', 'T', 'P', '/', '1', '.'})
	noMagic.expectError(CodeBadRequest)
	noMagic.expectClosed()

	// An authenticated client announcing a frame over MaxMessageBytes (of
	// another job: a second claimant of a rank of "good" would fail it).
	big := dialRaw(t, addr)
	big.hello("bad", "1", 2, 3)
	big.sendBytes(binary.BigEndian.AppendUint32(nil, 1<<20))
	if e := big.expectError(CodeTooLarge); !strings.Contains(e.Message, "limit 4096") {
		t.Errorf("too-large message %q does not name the limit", e.Message)
	}
	big.expectClosed()

	// A rank whose payload is over the limit hears why, even though the
	// server stops reading in the middle of its put.
	_, err := Allgather(context.Background(), ClientConfig{Addr: addr, Token: testToken, Job: "fat", Size: 2, Timeout: 10 * time.Second}, make([]byte, 8<<20))
	if !errors.Is(err, CodeTooLarge) || !strings.Contains(err.Error(), "limit 4096") {
		t.Errorf("oversized payload: err = %v", err)
	}

	// A put before hello, and a reply type sent as a request.
	early := dialRaw(t, addr)
	early.send(&Put{Key: "payload/2", Value: []byte("evil")})
	early.expectError(CodeBadRequest)
	early.expectClosed()
	confused := dialRaw(t, addr)
	confused.hello("bad", "1", 2, 3)
	confused.send(&Values{})
	confused.expectError(CodeBadRequest)
	confused.expectClosed()

	// A wrong protocol version.
	future := dialRaw(t, addr)
	future.send(&Hello{Version: 99, Token: testToken, Job: "good", Size: 3})
	future.expectError(CodeVersion)

	checkGathered(t, cfg, runRanks(cfg, []int{2}))
	checkGathered(t, cfg, <-results)
	logs.waitFor(t, "dropping client: message too large", `"remote":"127.0.0.1:`)
	logs.waitFor(t, "dropping client: message too large", `"job":"bad"`, `"rank":2`)
	logs.waitFor(t, "dropping client: malformed message")
}

func TestStalledClientIsDropped(t *testing.T) {
	t.Parallel()
	const idle = 300 * time.Millisecond
	_, addr, logs := startServer(t, ServerConfig{IdleTimeout: idle, HelloTimeout: idle / 2})

	// Half a frame header, then silence: the hello's shorter deadline.
	stalled := dialRaw(t, addr)
	stalled.sendBytes([]byte{0, 0})
	start := time.Now()
	stalled.expectClosed()
	if took := time.Since(start); took < idle*3/8 || took > idle/2+3*time.Second {
		t.Errorf("stalled client dropped after %s, hello timeout %s", took, idle/2)
	}
	logs.waitFor(t, `"level":"warn"`, `"before_hello":true`, "dropping stalled client", `"remote":"127.0.0.1:`)

	// After hello, a frame whose body never comes.
	slow := dialRaw(t, addr)
	slow.hello("slow", "", 0, 2)
	slow.sendBytes([]byte{0, 0, 0, 50, byte(TypePut)})
	slow.expectClosed()
	logs.waitFor(t, "dropping stalled client", `"job":"slow"`)

	// A rank blocked in a get is not idle: it outlives the idle timeout.
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "patient", Size: 2, Timeout: 10 * time.Second}
	late := make(chan map[int]result)
	go func() { late <- runRanks(cfg, []int{0}) }()
	logs.waitFor(t, "waiting for keys", `"job":"patient"`)
	time.Sleep(2 * idle)
	checkGathered(t, cfg, runRanks(cfg, []int{1}))
	checkGathered(t, cfg, <-late)
}

func TestNewAttemptDoesNotSeeOldPayloads(t *testing.T) {
	t.Parallel()
	_, addr, _ := startServer(t, ServerConfig{})
	// Attempt 1 dies half-way: ranks 0 and 1 wrote their addresses, rank 2
	// never came.
	old := ClientConfig{Addr: addr, Token: testToken, Job: "train", Attempt: "1", Size: 3, Timeout: 500 * time.Millisecond}
	for r, res := range runRanks(old, []int{0, 1}) {
		if !errors.Is(res.err, CodeTimeout) {
			t.Fatalf("attempt 1 rank %d: err = %v, want a timeout", r, res.err)
		}
	}
	// Attempt 2 starts with rank 2 first: the keys of ranks 0 and 1 are
	// still stored for attempt 1, and must not leak into attempt 2.
	cfg := old
	cfg.Attempt, cfg.Timeout = "2", 10*time.Second
	first := make(chan map[int]result)
	go func() { first <- runRanks(cfg, []int{2}) }()
	time.Sleep(100 * time.Millisecond)
	checkGathered(t, cfg, runRanks(cfg, []int{0, 1}))
	checkGathered(t, cfg, <-first)
}

func TestMissingRanksAreNamed(t *testing.T) {
	t.Parallel()
	s, addr, _ := startServer(t, ServerConfig{})
	const timeout = time.Second
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "train", Attempt: "3", Size: 4, Timeout: timeout}
	for r, res := range runRanks(cfg, []int{0, 1}) {
		want := `rendezvous job "train" attempt 3: ranks 2, 3 of 4 did not arrive within 1s`
		if res.err == nil || res.err.Error() != want {
			t.Errorf("rank %d: err = %v, want %s", r, res.err, want)
		}
		var e *Error
		if !errors.As(res.err, &e) || !errors.Is(res.err, CodeTimeout) || fmt.Sprint(e.Missing) != "[2 3]" {
			t.Errorf("rank %d: %#v is not a timeout naming ranks 2 and 3", r, res.err)
		}
		if res.took > timeout+replyGrace || res.took < timeout/2 {
			t.Errorf("rank %d failed after %s, deadline %s", r, res.took, timeout)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.jobs[jobKey{"train", "3", ""}].waiters; len(w) != 0 {
		t.Errorf("gets that timed out are still registered: %v", w)
	}
}

func TestRanksThatDisagree(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServer(t, ServerConfig{})
	ctx := context.Background()

	// Different world sizes: both ranks fail at once, the waiting one too.
	a := ClientConfig{Addr: addr, Token: testToken, Job: "sizes", Attempt: "1", Rank: 0, Size: 2, Timeout: 10 * time.Second}
	errA := make(chan error)
	go func() { _, err := Allgather(ctx, a, []byte("a")); errA <- err }()
	eventually(t, "rank 0 to join", func() bool { return strings.Contains(logs.String(), `"job":"sizes"`) })
	b := a
	b.Rank, b.Size = 1, 3
	start := time.Now()
	_, errB := Allgather(ctx, b, []byte("b"))
	want := `rendezvous job "sizes" attempt 1: rank 1 says the job has 3 ranks, but rank 0 said 2`
	for i, err := range []error{errB, <-errA} {
		if err == nil || err.Error() != want || !errors.Is(err, CodeMismatch) {
			t.Errorf("rank %d: err = %v, want %s", 1-i, err, want)
		}
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("a size mismatch took %s to report", took)
	}

	// Two processes claiming the same rank, with different addresses.
	d := ClientConfig{Addr: addr, Token: testToken, Job: "dup", Rank: 0, Size: 2, Timeout: 10 * time.Second}
	errD := make(chan error)
	go func() { _, err := Allgather(ctx, d, []byte("first")); errD <- err }()
	eventually(t, "first rank 0 to join", func() bool { return strings.Contains(logs.String(), `"job":"dup"`) })
	_, err := Allgather(ctx, d, []byte("second"))
	if !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), "rank 0 of job \"dup\" attempt \"\" was claimed by two processes") {
		t.Errorf("duplicate rank: err = %v", err)
	}
	if err := <-errD; !errors.Is(err, CodeDuplicate) {
		t.Errorf("duplicate rank, first process: err = %v", err)
	}

	// Rank out of range: the client refuses before dialling; a client
	// that does not, fails the job.
	_, err = Allgather(ctx, ClientConfig{Addr: addr, Token: testToken, Job: "range", Rank: 4, Size: 4}, nil)
	if !errors.Is(err, CodeBadRequest) || !strings.Contains(err.Error(), "rank 4 is out of range for a job of 4 ranks") {
		t.Errorf("local rank check: err = %v", err)
	}
	raw := dialRaw(t, addr)
	raw.send(&Hello{Version: ProtocolVersion, Token: testToken, Job: "range", Rank: 4, Size: 4})
	if e := raw.expectError(CodeMismatch); !strings.Contains(e.Message, "out of range") {
		t.Errorf("out of range: %q", e.Message)
	}
	_, err = Allgather(ctx, ClientConfig{Addr: addr, Token: testToken, Job: "range", Rank: 0, Size: 4, Timeout: 10 * time.Second}, nil)
	if !errors.Is(err, CodeMismatch) || !strings.Contains(err.Error(), "rank 4 is out of range") {
		t.Errorf("after an out-of-range rank: err = %v", err)
	}
}

// fakeListener only has an address: Serve must refuse it before accepting.
type fakeListener struct{ addr net.Addr }

func (f fakeListener) Accept() (net.Conn, error) { return nil, errors.New("unexpected accept") }
func (f fakeListener) Close() error              { return nil }
func (f fakeListener) Addr() net.Addr            { return f.addr }

func TestTokenRule(t *testing.T) {
	t.Parallel()
	public := fakeListener{&net.TCPAddr{IP: net.IPv4(10, 1, 2, 3), Port: 29700}}
	wildcard := fakeListener{&net.TCPAddr{IP: net.IPv4zero, Port: 29700}}

	s, _ := NewServer(ServerConfig{})
	if err := s.Serve(fakeListener{&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}}); err == nil || !strings.Contains(err.Error(), "without a token") {
		t.Errorf("no token, loopback, not insecure: %v", err)
	}
	s, _ = NewServer(ServerConfig{Insecure: true})
	for _, l := range []fakeListener{public, wildcard} {
		if err := s.Serve(l); err == nil || !strings.Contains(err.Error(), "loopback addresses only") {
			t.Errorf("insecure on %s: %v", l.addr, err)
		}
	}
	if _, err := NewServer(ServerConfig{Token: "t", MaxConns: -1}); err == nil {
		t.Error("negative MaxConns accepted")
	}

	// Insecure on loopback works, and so does a token anywhere.
	_, addr, _ := startServer(t, ServerConfig{Insecure: true})
	cfg := ClientConfig{Addr: addr, Job: "open", Size: 2, Timeout: 10 * time.Second}
	checkGathered(t, cfg, runRanks(cfg, allRanks(2)))
	if err := (&Server{cfg: ServerConfig{Token: "t"}}).checkAddr(public.addr); err != nil {
		t.Errorf("token on a public address: %v", err)
	}

	// HostAllgather without a token will not listen publicly either.
	_, err := HostAllgather(context.Background(), "0.0.0.0:0", ClientConfig{Job: "j", Size: 1, Timeout: time.Second}, nil)
	if want := `rendezvous job "j": refusing to host the rendezvous on 0.0.0.0:0 without a token: set one, or host on a loopback address`; err == nil || err.Error() != want {
		t.Errorf("host without token on a wildcard address: %v", err)
	}
}

func TestShutdown(t *testing.T) {
	t.Parallel()
	s, addr, logs := startServer(t, ServerConfig{})
	waiting := dialRaw(t, addr)
	waiting.hello("train", "1", 0, 2)
	waiting.send(&Put{Key: "payload/0", Value: []byte("a")})
	waiting.expect(TypeAck)
	waiting.send(&Get{WaitMillis: 60000, Keys: []string{"payload/0", "payload/1"}})
	idle := dialRaw(t, addr)
	idle.hello("train", "1", 1, 2)
	eventually(t, "both sessions", func() bool { s.mu.Lock(); defer s.mu.Unlock(); return len(s.sessions) == 2 })
	logs.waitFor(t, "waiting for keys", `"rank":0`)

	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("shutdown took %s", took)
	}
	waiting.expectError(CodeShuttingDown)
	waiting.expectClosed()
	idle.expectClosed()
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Error("still accepting after shutdown")
	}
	if err := s.Shutdown(ctx); err != nil {
		t.Errorf("second shutdown: %v", err)
	}
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	if err := s.Serve(l); !errors.Is(err, ErrServerClosed) {
		t.Errorf("serve after shutdown: %v", err)
	}
}

func TestShutdownDeadline(t *testing.T) {
	t.Parallel()
	s, addr, _ := startServerWith(t, ServerConfig{}, true)
	// A client that stops reading in the middle of a reply far larger than
	// the socket buffers: the session outlives a short grace period and is
	// closed by force.
	stuck := dialRaw(t, addr)
	stuck.c.(*net.TCPConn).SetReadBuffer(8 << 10)
	stuck.hello("big", "", 0, 1)
	stuck.send(&Put{Key: "k/0", Value: make([]byte, 1<<20-64)})
	stuck.expect(TypeAck)
	stuck.send(&Get{Keys: []string{"k/0"}})
	if _, err := stuck.br.Peek(1); err != nil { // the reply has begun
		t.Fatal(err)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if err := s.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("shutdown with a stuck client: %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("forced shutdown took %s", took)
	}
}

func TestJobsExpire(t *testing.T) {
	t.Parallel()
	s, addr, logs := startServer(t, ServerConfig{JobTTL: 200 * time.Millisecond})
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "crashed", Size: 2, Timeout: 300 * time.Millisecond}
	runRanks(cfg, []int{0})
	eventually(t, "the job to expire", func() bool { return jobCount(s) == 0 })
	logs.waitFor(t, `"message":"expired job"`, `"job":"crashed"`)

	// A job with a connected rank is kept however old it gets.
	raw := dialRaw(t, addr)
	raw.hello("alive", "", 0, 2)
	time.Sleep(500 * time.Millisecond)
	if n := jobCount(s); n != 1 {
		t.Errorf("%d jobs, want the live one", n)
	}
}

func TestLimits(t *testing.T) {
	t.Parallel()
	s, addr, logs := startServer(t, ServerConfig{MaxJobs: 1, MaxKeysPerJob: 4, MaxConns: 3})
	ctx := context.Background()

	first := dialRaw(t, addr)
	first.hello("one", "", 0, 2)
	_, err := Allgather(ctx, ClientConfig{Addr: addr, Token: testToken, Job: "two", Size: 1, Timeout: 5 * time.Second}, nil)
	if !errors.Is(err, CodeLimit) || !strings.Contains(err.Error(), "limit of 1 jobs") {
		t.Errorf("job limit: %v", err)
	}
	logs.waitFor(t, "rejecting job: job limit reached", `"job":"two"`)

	huge := dialRaw(t, addr)
	huge.send(&Hello{Version: ProtocolVersion, Token: testToken, Job: "one", Size: 5})
	huge.expectError(CodeLimit)

	// Connections: the fourth to say hello is told the server is busy
	// (the third is rank 0's process again: raw hellos share instance 0).
	second := dialRaw(t, addr)
	third := dialRaw(t, addr)
	second.hello("one", "", 1, 2)
	third.hello("one", "", 0, 2)
	eventually(t, "three sessions", func() bool { s.mu.Lock(); defer s.mu.Unlock(); return s.authed == 3 })
	fourth := dialRaw(t, addr)
	fourth.send(&Hello{Version: ProtocolVersion, Token: testToken, Job: "one", Size: 2})
	fourth.expectError(CodeBusy)
	fourth.expectClosed()
	logs.waitFor(t, "rejecting client: connection limit reached")

	// Keys per job: the fifth key fails the job.
	for i := range 4 {
		first.send(&Put{Key: fmt.Sprint("k", i, "/0"), Value: []byte("v")})
		first.expect(TypeAck)
	}
	first.send(&Put{Key: "k4/0", Value: []byte("v")})
	first.expectError(CodeLimit)
}

func TestClientLeavingWhileWaiting(t *testing.T) {
	t.Parallel()
	s, addr, logs := startServer(t, ServerConfig{})
	raw := dialRaw(t, addr)
	raw.hello("gone", "", 0, 2)
	raw.send(&Get{WaitMillis: 60000, Keys: []string{"payload/1"}})
	logs.waitFor(t, "waiting for keys", `"job":"gone"`)
	raw.c.Close()
	logs.waitFor(t, "client left while waiting", `"job":"gone"`)
	eventually(t, "the session to end", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.sessions) == 0 && s.jobs[jobKey{"gone", "", ""}].refs == 0
	})
}

func TestContextCancel(t *testing.T) {
	t.Parallel()
	_, addr, _ := startServer(t, ServerConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	_, err := Allgather(ctx, ClientConfig{Addr: addr, Token: testToken, Job: "c", Size: 2, Timeout: 10 * time.Second}, nil)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("cancel took %s", took)
	}
}

func TestUnreachableServer(t *testing.T) {
	t.Parallel()
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := l.Addr().String()
	l.Close()
	_, err := Allgather(context.Background(), ClientConfig{Addr: addr, Token: testToken, Job: "lost", Size: 2, Timeout: 300 * time.Millisecond}, nil)
	if !errors.Is(err, CodeTimeout) || !strings.Contains(err.Error(), "could not reach the server at "+addr+" within 300ms") {
		t.Errorf("err = %v", err)
	}
}

func TestErrorText(t *testing.T) {
	e := &Error{Code: CodeTimeout, Job: "train", Attempt: "3", Msg: rankList([]int{2, 3}) + " of 4 did not arrive within 10s"}
	if got, want := e.Error(), `rendezvous job "train" attempt 3: ranks 2, 3 of 4 did not arrive within 10s`; got != want {
		t.Errorf("got %s, want %s", got, want)
	}
	if got := (&Error{Job: "j", Attempt: "a b", Msg: "m"}).Error(); got != `rendezvous job "j" attempt "a b": m` {
		t.Errorf("got %s", got)
	}
	if got := rankList([]int{7}); got != "rank 7" {
		t.Errorf("got %s", got)
	}
	if got := rankList(allRanks(100)); got != "ranks 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, ... (85 more), 99" {
		t.Errorf("got %s", got)
	}
}
