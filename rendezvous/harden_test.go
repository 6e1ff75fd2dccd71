package rendezvous

// Tests for what comes from outside a job: other processes, other jobs,
// other users, idle sockets.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// A client may write only its own rank's keys: one that joined as rank 1
// cannot plant an address for rank 0.
func TestClientsWriteOnlyTheirOwnKeys(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServer(t, ServerConfig{})
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "victim", Size: 2, Timeout: 10 * time.Second}
	forger := dialRaw(t, addr)
	forger.send(&Hello{Version: ProtocolVersion, Token: testToken, Job: "victim", Rank: 1, Size: 2, Instance: 7})
	forger.expect(TypeAck)
	forger.send(&Put{Key: payloadKey(0), Value: []byte("poison")})
	if e := forger.expectError(CodeBadRequest); !strings.Contains(e.Message, `rank 1 may write only its own keys (ending in /1), not "payload/0"`) {
		t.Errorf("forged put: %q", e.Message)
	}
	forger.expectClosed()
	logs.waitFor(t, "dropping client: write to another rank's key", `"rank":1`)
	logs.waitFor(t, "rank went away before leaving", `"job":"victim"`)
	// The job itself is unharmed: the forger went away before writing
	// anything of its own, so the real rank 1 takes its place.
	checkGathered(t, cfg, runRanks(cfg, []int{0, 1}))
}

// Two processes holding one rank at once fail the job on every rank, with
// a message that says two runs share the job id and attempt.
func TestSecondClaimantFailsTheJob(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Job: "twice", Size: 2, Timeout: 10 * time.Second}
	host := make(chan error)
	go func() {
		_, err := HostAllgather(context.Background(), addr, cfg, []byte("zero"))
		host <- err
	}()
	// The first rank 1 joins and waits (it never writes, so the host waits too).
	first := dialRetry(t, addr)
	first.send(&Hello{Version: ProtocolVersion, Job: "twice", Rank: 1, Size: 2, Instance: 1})
	first.expect(TypeAck)
	second := cfg
	second.Rank = 1
	_, err := Allgather(context.Background(), second, []byte("one"))
	want := "rank 1 of job \"twice\" attempt \"\" was claimed by two processes"
	if !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), want) {
		t.Errorf("second rank 1: err = %v", err)
	}
	first.send(&Get{WaitMillis: 5000, Keys: []string{payloadKey(0), payloadKey(1)}})
	if e := first.expectError(CodeDuplicate); !strings.Contains(e.Message, want) {
		t.Errorf("first rank 1: %q", e.Message)
	}
	if err := <-host; !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), want) {
		t.Errorf("host: err = %v", err)
	}
}

// dialRetry connects to a server that is about to come up.
func dialRetry(t *testing.T, addr string) *rawConn {
	t.Helper()
	waitListening(t, addr)
	return dialRaw(t, addr)
}

// waitListening returns once something accepts connections on addr.
func waitListening(t *testing.T, addr string) {
	t.Helper()
	for range 1000 {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("nobody listens on %s", addr)
}

// Two runs of one job id and attempt from different launches, interleaved
// rank by rank on one embedded address: each meets only its own ranks. This
// is how two jobs with default settings crossed: A's rank 0 met B's rank 1,
// then B's rank 0 met A's rank 1.
func TestLaunchesStayApartEmbedded(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	a := ClientConfig{Addr: addr, Job: "halo", Launch: "launch-A", Size: 2, Timeout: 15 * time.Second}
	b := a
	b.Launch = "launch-B"
	results := make(chan string, 4)
	run := func(cfg ClientConfig, rank int, delay time.Duration) {
		time.Sleep(delay)
		cfg.Rank = rank
		payload := []byte(fmt.Sprintf("%s/%d", cfg.Launch, rank))
		var values [][]byte
		var err error
		if rank == 0 {
			values, err = HostAllgather(context.Background(), addr, cfg, payload)
		} else {
			values, err = Allgather(context.Background(), cfg, payload)
		}
		if err != nil {
			results <- fmt.Sprintf("%s rank %d: %v", cfg.Launch, rank, err)
			return
		}
		got := string(bytes.Join(values, []byte(" ")))
		if want := cfg.Launch + "/0 " + cfg.Launch + "/1"; got != want {
			results <- fmt.Sprintf("%s rank %d: got %q, want %q", cfg.Launch, rank, got, want)
			return
		}
		results <- ""
	}
	go run(a, 0, 0)
	go run(b, 1, 100*time.Millisecond)
	go run(a, 1, 400*time.Millisecond)
	go run(b, 0, 500*time.Millisecond)
	for range 4 {
		if r := <-results; r != "" {
			t.Error(r)
		}
	}
}

// The same through one shared server: launches are separate namespaces.
func TestLaunchesStayApartShared(t *testing.T) {
	t.Parallel()
	_, addr, _ := startServer(t, ServerConfig{})
	a := ClientConfig{Addr: addr, Token: testToken, Job: "halo", Launch: "A", Size: 2, Timeout: 10 * time.Second}
	b := a
	b.Launch = "B"
	var wg sync.WaitGroup
	var ra, rb map[int]result
	wg.Add(2)
	go func() { defer wg.Done(); ra = runRanks(a, []int{0, 1}) }()
	go func() { defer wg.Done(); rb = runRanks(b, []int{1, 0}) }()
	wg.Wait()
	checkLaunch(t, a, ra)
	checkLaunch(t, b, rb)
}

func checkLaunch(t *testing.T, cfg ClientConfig, res map[int]result) {
	t.Helper()
	checkGathered(t, cfg, res) // payloadFor names job and attempt only
	for r, got := range res {
		if got.err == nil && len(got.values) != cfg.Size {
			t.Errorf("launch %s rank %d: %d values", cfg.Launch, r, len(got.values))
		}
	}
}

// A second process that thinks it is rank 0 finds the address taken by its
// own job's rendezvous: both fail, saying why, instead of one waiting
// forever or joining.
func TestSecondHostFailsLoudly(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Job: "two-zeros", Size: 2, Timeout: 10 * time.Second}
	first := make(chan error)
	go func() {
		_, err := HostAllgather(context.Background(), addr, cfg, []byte("a"))
		first <- err
	}()
	dialRetry(t, addr).c.Close()
	start := time.Now()
	_, err := HostAllgather(context.Background(), addr, cfg, []byte("b"))
	want := `rank 0 of job "two-zeros" attempt "" was claimed by two processes`
	if !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), want) {
		t.Errorf("second rank 0: err = %v", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("the second rank 0 took %s", took)
	}
	// The first serves on until rank 1, which comes later, is told too.
	one := cfg
	one.Rank = 1
	if _, err := Allgather(context.Background(), one, nil); !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), want) {
		t.Errorf("rank 1: err = %v", err)
	}
	if err := <-first; !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), want) {
		t.Errorf("first rank 0: err = %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("took %s", took)
	}
}

// A rank 0 whose address another job's rendezvous holds waits for it, and
// does not join that rendezvous; one whose address something else holds
// fails at its deadline naming the address; one that finds a shared server
// there says so at once.
func TestHostWaitsForItsAddress(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	// Another job's rank 0, whose rank 1 comes 600 ms later.
	other := ClientConfig{Addr: addr, Job: "other", Size: 2, Timeout: 10 * time.Second}
	otherDone := make(chan error, 2)
	go func() { _, err := HostAllgather(context.Background(), addr, other, []byte("o0")); otherDone <- err }()
	dialRetry(t, addr).c.Close()
	go func() {
		time.Sleep(600 * time.Millisecond)
		o := other
		o.Rank = 1
		_, err := Allgather(context.Background(), o, []byte("o1"))
		otherDone <- err
	}()
	mine := ClientConfig{Addr: addr, Job: "mine", Size: 2, Timeout: 10 * time.Second}
	res := make(chan map[int]result)
	go func() { res <- runRanks(mine, []int{1}) }()
	host := mine
	values, err := HostAllgather(context.Background(), addr, host, payloadFor("mine", "", 0))
	checkGathered(t, mine, map[int]result{0: {values: values, err: err}})
	checkGathered(t, mine, <-res)
	for range 2 {
		if err := <-otherDone; err != nil {
			t.Errorf("the other job: %v", err)
		}
	}

	// Something that is not a rendezvous holds the address.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	busy := ClientConfig{Addr: l.Addr().String(), Job: "mine", Size: 2, Timeout: 700 * time.Millisecond}
	_, err = HostAllgather(context.Background(), "", busy, nil)
	if !errors.Is(err, ErrAddressInUse) || !strings.Contains(err.Error(), l.Addr().String()+" was still in use after 700ms") {
		t.Errorf("address held: err = %v", err)
	}

	// A shared server.
	_, shared, _ := startServer(t, ServerConfig{Token: "t"})
	_, err = HostAllgather(context.Background(), "", ClientConfig{Addr: shared, Token: "t", Job: "mine", Size: 2, Timeout: 5 * time.Second}, nil)
	if !errors.Is(err, ErrSharedServer) {
		t.Errorf("shared server at the address: err = %v", err)
	}
}

// A rank that wrote its address and died before the others read it does
// not hand that address to a restarted run that kept the attempt id.
func TestDeadRanksAddressIsNotHandedOut(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServer(t, ServerConfig{})
	dead := dialRaw(t, addr)
	dead.send(&Hello{Version: ProtocolVersion, Token: testToken, Job: "restart", Rank: 0, Size: 2, Instance: 1})
	dead.expect(TypeAck)
	dead.send(&Put{Key: payloadKey(0), Value: []byte("dead address")})
	dead.expect(TypeAck)
	dead.c.Close()
	logs.waitFor(t, "rank went away before leaving", `"job":"restart"`)
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "restart", Size: 2, Timeout: 10 * time.Second}
	res := make(chan map[int]result)
	go func() { res <- runRanks(cfg, []int{1}) }()
	time.Sleep(200 * time.Millisecond) // rank 1 waits; the dead value must not satisfy it
	checkGathered(t, cfg, runRanks(cfg, []int{0}))
	checkGathered(t, cfg, <-res)
}

// A rank killed during the rendezvous is named at once, and the message
// says what happened and when (it used to read "did not collect the result
// within 13s", after 5 s).
func TestKilledRankIsNamed(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Job: "killed", Size: 2, Timeout: 5 * time.Second}
	go func() {
		victim := dialRetry(t, addr)
		victim.send(&Hello{Version: ProtocolVersion, Job: "killed", Rank: 1, Size: 2, Instance: 1})
		victim.expect(TypeAck)
		victim.send(&Put{Key: payloadKey(1), Value: []byte("one")})
		victim.expect(TypeAck)
		victim.c.Close() // SIGKILL, as far as the server can tell
	}()
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	defer cancel()
	start := time.Now()
	_, err := HostAllgather(ctx, addr, cfg, []byte("zero"))
	took := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "rank 1 of 2 disconnected") || !strings.Contains(err.Error(), "its process ended") {
		t.Errorf("err = %v", err)
	}
	if took > 3*time.Second {
		t.Errorf("took %s to notice", took)
	}
}

// A rank that arrives after the job failed is told why, not left to find
// nobody listening ("could not reach the server ... connection refused").
func TestLateRanksAreTold(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Job: "sizes", Size: 2, Timeout: 5 * time.Second}
	host := make(chan error)
	go func() { _, err := HostAllgather(context.Background(), addr, cfg, []byte("zero")); host <- err }()
	dialRetry(t, addr).c.Close()
	want := "rank 1 says the job has 3 ranks, but rank 0 said 2"
	wrong := cfg
	wrong.Rank, wrong.Size = 1, 3
	if _, err := Allgather(context.Background(), wrong, nil); !errors.Is(err, CodeMismatch) || !strings.Contains(err.Error(), want) {
		t.Errorf("rank 1: %v", err)
	}
	time.Sleep(500 * time.Millisecond)
	late := wrong
	late.Rank = 2
	if _, err := Allgather(context.Background(), late, nil); !errors.Is(err, CodeMismatch) || !strings.Contains(err.Error(), want) {
		t.Errorf("late rank 2: %v", err)
	}
	if err := <-host; !errors.Is(err, CodeMismatch) {
		t.Errorf("host: %v", err)
	}
}

// Idle sockets that never say hello neither count against MaxConns nor
// stay long: a job gets in while a hundred of them are open.
func TestIdleSocketsDoNotLockJobsOut(t *testing.T) {
	t.Parallel()
	_, addr, logs := startServer(t, ServerConfig{MaxConns: 4, MaxUnauthenticated: 8, HelloTimeout: 2 * time.Second})
	var idle []net.Conn
	for range 100 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	defer func() {
		for _, c := range idle {
			c.Close()
		}
	}()
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "real", Size: 3, Timeout: 5 * time.Second}
	start := time.Now()
	res := runRanks(cfg, []int{0, 1, 2})
	checkGathered(t, cfg, res)
	if took := time.Since(start); took > 1500*time.Millisecond {
		t.Errorf("the job took %s to meet", took)
	}
	logs.waitFor(t, "dropping client that has not said hello: too many such connections")
}

// Without a token, only the server's own user may join.
func TestOtherUsersAreRefused(t *testing.T) {
	uid, err := peerUIDOf(t)
	if errors.Is(err, errUIDUnsupported) {
		t.Skip(err)
	}
	if err != nil || uid != os.Getuid() {
		t.Fatalf("our own connection's owner: %d, %v (we are %d)", uid, err, os.Getuid())
	}
	old := lookupPeerUID
	lookupPeerUID = func(net.Conn) (int, error) { return os.Getuid() + 1, nil }
	defer func() { lookupPeerUID = old }()
	_, addr, _ := startServer(t, ServerConfig{Insecure: true})
	_, err = Allgather(context.Background(), ClientConfig{Addr: addr, Job: "j", Size: 1, Timeout: 2 * time.Second}, nil)
	want := fmt.Sprintf("takes only its own user's processes (uid %d), not uid %d", os.Getuid(), os.Getuid()+1)
	if !errors.Is(err, CodeUnauthorized) || !strings.Contains(err.Error(), want) {
		t.Errorf("err = %v", err)
	}
}

// peerUIDOf looks up the owner of a loopback connection of our own, over
// IPv4 and, where there is one, IPv6.
func peerUIDOf(t *testing.T) (int, error) {
	t.Helper()
	uid := -1
	for _, network := range []string{"127.0.0.1:0", "[::1]:0"} {
		l, err := net.Listen("tcp", network)
		if err != nil {
			continue
		}
		defer l.Close()
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		u, err := peerUID(s)
		if err != nil {
			return u, fmt.Errorf("%s: %w", network, err)
		}
		uid = u
	}
	return uid, nil
}
