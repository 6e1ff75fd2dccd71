package rendezvous

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"
)

// presentRanks runs Present for every rank of cfg's job at once.
func presentRanks(t *testing.T, cfg ClientConfig) []*Presence {
	t.Helper()
	ps := make([]*Presence, cfg.Size)
	var wg sync.WaitGroup
	for r := range cfg.Size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := cfg
			c.Rank = r
			_, p, err := Present(context.Background(), c, payloadFor(cfg.Job, cfg.Attempt, r))
			if err != nil {
				t.Errorf("rank %d: %v", r, err)
				return
			}
			ps[r] = p
		}()
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	return ps
}

// A rank that arrives for a job whose ranks have all met and still hold their
// connections belongs to another run under the same name: it is refused at
// once, naming the job and its rank, and the running ranks are told (they may
// have met that other run's ranks). Issue 24 §1: before, the server forgot a
// complete job at once and paired the latecomers as a new one.
func TestLatecomerToARunningJobIsRefused(t *testing.T) {
	t.Parallel()
	_, addr, _ := startServer(t, ServerConfig{})
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "same", Attempt: "1", Size: 2, Timeout: 5 * time.Second}
	ps := presentRanks(t, cfg)
	defer func() {
		for _, p := range ps {
			p.Close()
		}
	}()
	late := cfg
	late.Rank = 1
	start := time.Now()
	_, err := Allgather(context.Background(), late, []byte("another run"))
	var e *Error
	if !errors.As(err, &e) || e.Code != CodeDuplicate {
		t.Fatalf("latecomer: got %v, want CodeDuplicate", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("latecomer refused after %v, want at once", took)
	}
	for _, want := range []string{`"same"`, "rank 1 ", "had met"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("latecomer's error %q does not say %q", err, want)
		}
	}
	for r, p := range ps {
		select {
		case <-p.Done():
		case <-time.After(5 * time.Second):
			t.Fatalf("rank %d was not told", r)
		}
		if !errors.Is(p.Err(), CodeDuplicate) {
			t.Errorf("rank %d told %v, want CodeDuplicate", r, p.Err())
		}
	}
	// The other latecomer, a moment later, hears the same.
	late.Rank = 0
	if _, err := Allgather(context.Background(), late, []byte("another run")); !errors.Is(err, CodeDuplicate) || !strings.Contains(err.Error(), "rank 0 ") {
		t.Errorf("second latecomer: got %v, want CodeDuplicate naming rank 0", err)
	}
}

// Once every rank of a complete job has hung up, the job is over: the next
// run under the same name meets afresh, as with ranks that do not stay.
func TestJobIdIsFreeAgainWhenItsRanksHangUp(t *testing.T) {
	t.Parallel()
	s, addr, _ := startServer(t, ServerConfig{})
	cfg := ClientConfig{Addr: addr, Token: testToken, Job: "rerun", Size: 2, Timeout: 5 * time.Second}
	for run := range 2 {
		ps := presentRanks(t, cfg)
		for _, p := range ps {
			if err := p.Close(); err != nil || p.Err() != nil {
				t.Errorf("run %d: close %v, notice %v", run, err, p.Err())
			}
		}
		eventually(t, "the job forgotten", func() bool { return jobCount(s) == 0 })
	}
}
