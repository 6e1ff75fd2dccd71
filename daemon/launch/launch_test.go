package launch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

func env(kv ...string) func(string) string {
	m := map[string]string{}
	for i := 0; i < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) string { return m[k] }
}

func TestDetect(t *testing.T) {
	for _, tc := range []struct {
		name   string
		env    func(string) string
		want   string // launcher rank/size local nodes job attempt
		ok     bool
		single bool
	}{
		{"none", env(), "", false, false},
		{"torchrun", env("RANK", "3", "WORLD_SIZE", "8", "LOCAL_RANK", "3", "LOCAL_WORLD_SIZE", "8", "TORCHELASTIC_RUN_ID", "r1", "TORCHELASTIC_RESTART_COUNT", "2", "MASTER_ADDR", "n0"),
			"torchrun 3/8 local 3/8 nodes -1 job r1 attempt 2 master n0", true, true},
		{"openmpi", env("OMPI_COMM_WORLD_RANK", "1", "OMPI_COMM_WORLD_SIZE", "4", "OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
			"openmpi 1/4 local -1/2 nodes -1 job  attempt  master ", true, false},
		{"slurm", env("SLURM_PROCID", "5", "SLURM_NTASKS", "64", "SLURM_STEP_NUM_TASKS", "16", "SLURM_STEP_NUM_NODES", "2", "SLURM_JOB_ID", "77", "SLURM_STEP_ID", "0"),
			"slurm 5/16 local -1/-1 nodes 2 job 77.0 attempt  master ", true, false},
		{"torchrun under slurm", env("RANK", "0", "WORLD_SIZE", "2", "SLURM_PROCID", "9", "SLURM_NTASKS", "10"),
			"torchrun 0/2 local -1/-1 nodes -1 job  attempt  master ", true, false},
	} {
		p, ok, err := Detect(tc.env)
		if err != nil || ok != tc.ok {
			t.Errorf("%s: ok %v, err %v", tc.name, ok, err)
			continue
		}
		if !ok {
			continue
		}
		got := fmt.Sprintf("%s %d/%d local %d/%d nodes %d job %s attempt %s master %s", p.Launcher, p.Rank, p.Size,
			p.LocalRank, p.LocalSize, p.Nodes, p.JobID, p.Attempt, p.MasterAddr)
		if got != tc.want || p.SingleHost() != tc.single {
			t.Errorf("%s:\n got %s (single host %v)\nwant %s (single host %v)", tc.name, got, p.SingleHost(), tc.want, tc.single)
		}
	}
	for _, bad := range []func(string) string{
		env("RANK", "x", "WORLD_SIZE", "2"),
		env("RANK", "2", "WORLD_SIZE", "2"),
		env("OMPI_COMM_WORLD_RANK", "0", "OMPI_COMM_WORLD_SIZE", "0"),
	} {
		if _, _, err := Detect(bad); err == nil {
			t.Error("bad launcher variables accepted")
		}
	}
}

func TestMasterRendezvous(t *testing.T) {
	for _, tc := range []struct {
		addr, port, want string
		ok, bad          bool
	}{
		{"", "29500", "", false, false},
		{"n0", "29500", "n0:29501", true, false},
		{"10.0.0.1", "", "10.0.0.1:29700", true, false},
		{"[fd00::1]", "1234", "[fd00::1]:1235", true, false},
		{"n0", "65535", "", false, true},
		{"n0", "x", "", false, true},
	} {
		got, ok, err := Placement{MasterAddr: tc.addr, MasterPort: tc.port}.MasterRendezvous("29700")
		if got != tc.want || ok != tc.ok || (err != nil) != tc.bad {
			t.Errorf("MASTER_ADDR=%q MASTER_PORT=%q: %q, %v, %v; want %q, %v, error %v", tc.addr, tc.port, got, ok, err, tc.want, tc.ok, tc.bad)
		}
	}
	p, ok, err := Detect(env("OMPI_COMM_WORLD_RANK", "0", "OMPI_COMM_WORLD_SIZE", "2", "MASTER_ADDR", "h", "MASTER_PORT", "7"))
	if !ok || err != nil || p.MasterAddr != "h" || p.MasterPort != "7" {
		t.Errorf("MASTER_ADDR/MASTER_PORT under mpirun: %+v %v %v", p, ok, err)
	}
}

func sh(script string) *Local {
	return &Local{
		Path: "/bin/sh",
		Args: []string{"-c", script},
		Env:  func(r int) []string { return []string{fmt.Sprintf("R=%d", r)} },
		Log:  zerolog.Nop(),
	}
}

func TestLocalSuccess(t *testing.T) {
	var out bytes.Buffer
	l := sh(`echo rank $R`)
	l.N, l.Stdout = 3, &out
	if err := l.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < 3; r++ {
		if !strings.Contains(out.String(), fmt.Sprintf("rank %d\n", r)) {
			t.Errorf("rank %d did not run: %q", r, out.String())
		}
	}
}

// A failing rank stops the others at once, and is named as the cause.
func TestLocalFailureStopsTheOthers(t *testing.T) {
	l := sh(`if [ "$R" = 1 ]; then sleep 0.2; exit 5; fi; exec sleep 30`)
	l.N, l.Grace = 3, time.Second
	start := time.Now()
	err := l.Run(context.Background())
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v, want a launch error", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("took %v: the other ranks were not stopped", took)
	}
	if e.First.Rank != 1 || e.First.Code != 5 || e.ExitCode() != 5 {
		t.Errorf("first failure %+v, exit code %d", e.First, e.ExitCode())
	}
	if !strings.Contains(e.Error(), "rank 1 (pid") || !strings.Contains(e.Error(), "exited with status 5") || !strings.Contains(e.Error(), "was stopped") {
		t.Errorf("message: %s", e.Error())
	}
}

// A rank that ignores SIGTERM is killed after the grace period.
func TestLocalKillsStubbornRanks(t *testing.T) {
	l := sh(`if [ "$R" = 0 ]; then exit 1; fi; trap "" TERM; sleep 30 & wait; sleep 30`)
	l.N, l.Grace = 2, 300*time.Millisecond
	start := time.Now()
	err := l.Run(context.Background())
	if err == nil {
		t.Fatal("no error")
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("took %v", took)
	}
}

func TestLocalInterrupted(t *testing.T) {
	l := sh(`exec sleep 30`)
	l.N, l.Grace = 2, time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	err := l.Run(ctx)
	var e *Error
	if !errors.As(err, &e) || !e.Interrupted {
		t.Fatalf("got %v, want an interrupted run", err)
	}
}

func TestCPUs(t *testing.T) {
	cpus, err := AllowedCPUs()
	if err != nil || len(cpus) == 0 {
		t.Fatalf("AllowedCPUs: %v, %v", cpus, err)
	}
	if got := fmt.Sprint(Spread(5, []int{2, 3})); got != "[2 3 2 3 2]" {
		t.Errorf("Spread(5, [2 3]) = %s", got)
	}
}
