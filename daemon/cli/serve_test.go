package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/halo-cp/halo/rendezvous"
)

const serveToken = "serve-test-token"

// startServe runs halod serve on a free loopback port and returns it with
// the address it listens on (read from its log).
func startServe(t *testing.T, env []string, args ...string) (*background, string) {
	t.Helper()
	args = append([]string{"serve", "--listen", "127.0.0.1:0", "--log-level", "debug"}, args...)
	b := startHalod(t, append([]string{"HALO_TOKEN=" + serveToken}, env...), args...)
	line := b.stderr.waitLog(t, "rendezvous server listening")
	addr, _ := line["addr"].(string)
	if addr == "" {
		t.Fatalf("no address in %v", line)
	}
	return b, addr
}

// allgather runs one job's ranks against addr and returns their results.
func allgather(addr, token, job, attempt string, size int, ranks []int, timeout time.Duration) ([][][]byte, []error) {
	res := make([][][]byte, len(ranks))
	errs := make([]error, len(ranks))
	var wg sync.WaitGroup
	for i, r := range ranks {
		wg.Add(1)
		go func(i, r int) {
			defer wg.Done()
			cfg := rendezvous.ClientConfig{Addr: addr, Token: token, Job: job, Attempt: attempt, Rank: r, Size: size, Timeout: timeout}
			res[i], errs[i] = rendezvous.Allgather(context.Background(), cfg, []byte(fmt.Sprintf("%s/%s/%d", job, attempt, r)))
		}(i, r)
	}
	wg.Wait()
	return res, errs
}

func checkJob(t *testing.T, job, attempt string, size int, res [][][]byte, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Errorf("job %s rank %d: %v", job, i, err)
			continue
		}
		for r, v := range res[i] {
			if want := fmt.Sprintf("%s/%s/%d", job, attempt, r); string(v) != want {
				t.Errorf("job %s: rank %d got %q for rank %d, want %q", job, i, v, r, want)
			}
		}
		if len(res[i]) != size {
			t.Errorf("job %s: %d values for %d ranks", job, len(res[i]), size)
		}
	}
}

func all(n int) []int {
	r := make([]int, n)
	for i := range r {
		r[i] = i
	}
	return r
}

func TestServeSeveralJobs(t *testing.T) {
	t.Parallel()
	_, addr := startServe(t, nil)
	var wg sync.WaitGroup
	for j := 0; j < 4; j++ {
		wg.Add(1)
		go func(j int) {
			defer wg.Done()
			job := fmt.Sprintf("job%d", j)
			res, errs := allgather(addr, serveToken, job, "1", 3+j, all(3+j), 20*time.Second)
			checkJob(t, job, "1", 3+j, res, errs)
		}(j)
	}
	wg.Wait()
}

func TestServeWrongToken(t *testing.T) {
	t.Parallel()
	b, addr := startServe(t, nil)
	_, errs := allgather(addr, "not-the-token", "j", "", 1, []int{0}, 5*time.Second)
	if !errors.Is(errs[0], rendezvous.CodeUnauthorized) || !strings.Contains(errs[0].Error(), "rejected the token") {
		t.Errorf("wrong token: %v", errs[0])
	}
	b.stderr.waitLog(t, "rejecting client: bad token")
	res, errs := allgather(addr, serveToken, "j", "", 2, all(2), 10*time.Second)
	checkJob(t, "j", "", 2, res, errs)
}

func TestServeGarbageIsDroppedAlone(t *testing.T) {
	t.Parallel()
	b, addr := startServe(t, nil)
	// One rank of a good job waits while garbage arrives.
	done := make(chan struct{})
	var res [][][]byte
	var errs []error
	go func() {
		res, errs = allgather(addr, serveToken, "good", "", 2, all(2), 20*time.Second)
		close(done)
	}()
	for _, junk := range []string{"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "\x00\x00\x00\x05\x01HLRVgarbage", "\xff\xff\xff\xff"} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte(junk))
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 512)
		for {
			if _, err := c.Read(buf); err != nil {
				break // the server hung up on us
			}
		}
		c.Close()
	}
	<-done
	checkJob(t, "good", "", 2, res, errs)
	if !strings.Contains(b.stderr.String(), "dropping client") {
		t.Errorf("no log line about dropping the garbage:\n%s", b.stderr.String())
	}
}

func TestServeStalledClientIsDropped(t *testing.T) {
	t.Parallel()
	b, addr := startServe(t, nil, "--idle-timeout", "300ms")
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte{0, 0}) // half a frame header, then nothing
	res, errs := allgather(addr, serveToken, "busy", "", 3, all(3), 20*time.Second)
	checkJob(t, "busy", "", 3, res, errs)
	b.stderr.waitLog(t, "dropping stalled client")
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 64)); err == nil {
		t.Error("the stalled connection is still open")
	}
}

func TestServeRestartedJobGetsNoOldAddresses(t *testing.T) {
	t.Parallel()
	_, addr := startServe(t, nil)
	// Attempt 1: only rank 1 arrives, then gives up.
	_, errs := allgather(addr, serveToken, "train", "1", 2, []int{1}, time.Second)
	if errs[0] == nil {
		t.Fatal("attempt 1 with a missing rank succeeded")
	}
	// Attempt 2: rank 0 alone must not see attempt 1's rank 1.
	_, errs = allgather(addr, serveToken, "train", "2", 2, []int{0}, time.Second)
	var e *rendezvous.Error
	if !errors.As(errs[0], &e) || fmt.Sprint(e.Missing) != "[1]" {
		t.Fatalf("attempt 2, rank 0 alone: %v (want rank 1 missing)", errs[0])
	}
	// Attempt 3 with every rank sees only its own payloads.
	res, errs := allgather(addr, serveToken, "train", "3", 2, all(2), 10*time.Second)
	checkJob(t, "train", "3", 2, res, errs)
}

func TestServeMissingRanksAreNamed(t *testing.T) {
	t.Parallel()
	_, addr := startServe(t, nil)
	start := time.Now()
	_, errs := allgather(addr, serveToken, "short", "", 4, []int{0, 2}, 1500*time.Millisecond)
	for i, err := range errs {
		var e *rendezvous.Error
		if !errors.As(err, &e) || fmt.Sprint(e.Missing) != "[1 3]" || !strings.Contains(err.Error(), "ranks 1, 3 of 4 did not arrive") {
			t.Errorf("rank %d: %v", []int{0, 2}[i], err)
		}
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the waiting ranks failed after %v, not at their deadline", took)
	}
}

func TestServeSIGTERM(t *testing.T) {
	t.Parallel()
	b, addr := startServe(t, nil, "--shutdown-timeout", "2s")
	waiting := make(chan error, 1)
	go func() {
		_, errs := allgather(addr, serveToken, "w", "", 2, []int{0}, 3*time.Second)
		waiting <- errs[0]
	}()
	b.stderr.waitLog(t, "client joined")
	b.cmd.Process.Signal(syscall.SIGTERM)
	if code := b.wait(t, 5*time.Second); code != 0 {
		t.Errorf("exit status %d after SIGTERM", code)
	}
	b.stderr.waitLog(t, "shutting down")
	b.stderr.waitLog(t, "stopped")
	if err := <-waiting; err == nil {
		t.Error("the waiting rank succeeded")
	}
}

func TestServeInsecureLoopback(t *testing.T) {
	t.Parallel()
	b := startHalod(t, nil, "serve", "--insecure", "--listen", "127.0.0.1:0")
	addr, _ := b.stderr.waitLog(t, "rendezvous server listening")["addr"].(string)
	res, errs := allgather(addr, "", "open", "", 2, all(2), 10*time.Second)
	checkJob(t, "open", "", 2, res, errs)
}

func TestServeFromEnvironment(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	os.WriteFile(tokenFile, []byte("from-a-file\n"), 0o600)
	b := startHalod(t, []string{"HALO_LISTEN=127.0.0.1:0", "HALO_TOKEN_FILE=" + tokenFile, "HALO_MAX_KEYS_PER_JOB=2", "HALO_LOG_FORMAT=json"}, "serve")
	addr, _ := b.stderr.waitLog(t, "rendezvous server listening")["addr"].(string)
	res, errs := allgather(addr, "from-a-file", "env", "", 2, all(2), 10*time.Second)
	checkJob(t, "env", "", 2, res, errs)
	// HALO_MAX_KEYS_PER_JOB=2 caps the world size.
	_, errs = allgather(addr, "from-a-file", "big", "", 3, all(3), 5*time.Second)
	if errs[0] == nil {
		t.Error("a job of 3 ranks passed a limit of 2 keys per job")
	}
}

func TestServeAddressInUse(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	r := halod(t, []string{"HALO_TOKEN=x"}, "serve", "--listen", l.Addr().String())
	if r.code != 1 || !strings.Contains(r.stderr, "address already in use") {
		t.Errorf("exit %d:\n%s", r.code, r.stderr)
	}
}
