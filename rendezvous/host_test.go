package rendezvous

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// freeAddr finds a loopback port for a server that starts later.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestHostAllgatherClientsFirst(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "embedded", Attempt: "7", Size: 4, Timeout: 10 * time.Second}
	others := make(chan map[int]result)
	go func() { others <- runRanks(cfg, []int{1, 2, 3}) }()
	// The other ranks are already knocking when rank 0 comes up.
	time.Sleep(300 * time.Millisecond)
	host := cfg
	host.Rank = 0
	values, err := HostAllgather(context.Background(), "", host, payloadFor(cfg.Job, cfg.Attempt, 0))
	checkGathered(t, cfg, map[int]result{0: {values: values, err: err}})
	checkGathered(t, cfg, <-others)
	// Everybody has the result, so the host has closed its server.
	if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		c.Close()
		t.Error("the host still serves after the allgather")
	}
}

func TestHostAllgatherAlone(t *testing.T) {
	t.Parallel()
	cfg := ClientConfig{Addr: freeAddr(t), Job: "solo", Size: 1, Timeout: 5 * time.Second}
	values, err := HostAllgather(context.Background(), "", cfg, []byte("me"))
	if err != nil || len(values) != 1 || string(values[0]) != "me" {
		t.Fatalf("got %q, %v", values, err)
	}
}

// When the host gives up, the ranks still waiting hear why instead of
// waiting out their own, later, deadlines.
func TestHostFailureIsRelayed(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "partial", Attempt: "2", Size: 3, Timeout: 10 * time.Second}
	rank1 := make(chan result)
	go func() {
		start := time.Now()
		c := cfg
		c.Rank = 1
		v, err := Allgather(context.Background(), c, []byte("one"))
		rank1 <- result{v, err, time.Since(start)}
	}()
	host := cfg
	host.Timeout = time.Second
	_, err := HostAllgather(context.Background(), addr, host, []byte("zero"))
	if want := `rendezvous job "partial" attempt 2: rank 2 of 3 did not arrive within 1s`; err == nil || err.Error() != want {
		t.Errorf("host: err = %v, want %s", err, want)
	}
	res := <-rank1
	if want := `rendezvous job "partial" attempt 2: the hosting rank 0 gave up: rank 2 of 3 did not arrive within 1s`; res.err == nil || res.err.Error() != want {
		t.Errorf("rank 1: err = %v, want %s", res.err, want)
	}
	if !errors.Is(res.err, CodeAborted) || res.took > 5*time.Second {
		t.Errorf("rank 1 took %s to fail with %v", res.took, res.err)
	}
}

func TestHostRejectsOtherJobs(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "mine", Attempt: "2", Size: 2, Timeout: 3 * time.Second}
	hostErr := make(chan error)
	go func() {
		_, err := HostAllgather(context.Background(), addr, cfg, []byte("zero"))
		hostErr <- err
	}()
	// A rank of another attempt is turned away for as long as the host
	// serves (it waits for its own host until its deadline). It starts
	// once the host listens: a budget spent before that (a loaded machine)
	// would only say that nobody listened.
	waitListening(t, addr)
	stale := cfg
	stale.Attempt, stale.Rank, stale.Timeout = "1", 1, time.Second
	_, err := Allgather(context.Background(), stale, []byte("old"))
	if !errors.Is(err, CodeOtherJob) || !strings.Contains(err.Error(), `serves the rendezvous of job "mine" attempt "2", not of job "mine" attempt "1"`) {
		t.Errorf("stale attempt: err = %v", err)
	}
	cfg.Rank = 1
	values, err := Allgather(context.Background(), cfg, []byte("one"))
	if err != nil || string(values[0]) != "zero" || string(values[1]) != "one" {
		t.Errorf("rank 1: %q, %v", values, err)
	}
	if err := <-hostErr; err != nil {
		t.Errorf("host: %v", err)
	}
}

func TestHostWaitsForStragglers(t *testing.T) {
	t.Parallel()
	// A rank that never collects its result makes the host fail once its
	// linger is over, naming that rank.
	addr := freeAddr(t)
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "straggle", Size: 2, Timeout: 500 * time.Millisecond}
	go func() {
		// Rank 1 writes its payload and never asks for the result.
		for range 200 {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			defer c.Close()
			frames := AppendFrame(nil, &Hello{Version: ProtocolVersion, Token: testToken, Job: "straggle", Rank: 1, Size: 2})
			c.Write(AppendFrame(frames, &Put{Key: payloadKey(1), Value: []byte("one")}))
			io.Copy(io.Discard, c)
			return
		}
	}()
	start := time.Now()
	_, err := hostAllgather(context.Background(), addr, cfg, []byte("zero"), 200*time.Millisecond)
	if !errors.Is(err, CodeTimeout) || !strings.Contains(err.Error(), "rank 1 of 2 did not collect the result within 5") {
		t.Errorf("err = %v", err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("host took %s", took)
	}
}

// A rank turned away by another job's server, whose last try is then cut
// off by its own deadline, still says whose server held the address.
func TestOtherJobOutlastsOwnDeadline(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for n := 0; ; n++ {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			if n == 0 {
				c.Write(AppendFrame(nil, &ErrorReply{Code: CodeOtherJob, Message: `serves job "theirs"`}))
			} // later connections are accepted and never answered
		}
	}()
	cfg := ClientConfig{Addr: l.Addr().String(), Token: testToken, Job: "mine", Rank: 1, Size: 2, Timeout: 700 * time.Millisecond}
	_, err = Allgather(context.Background(), cfg, []byte("one"))
	if !errors.Is(err, CodeOtherJob) || !strings.Contains(err.Error(), `still served another job after 700ms: serves job "theirs"`) {
		t.Errorf("err = %v", err)
	}
}
