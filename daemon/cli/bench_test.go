package cli

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/halo-cp/halo/daemon/benchmark"
)

// dataLines are the table's rows.
func dataLines(out string) []string {
	var rows []string
	for _, l := range strings.Split(out, "\n") {
		if strings.TrimSpace(l) != "" && !strings.HasPrefix(l, "#") {
			rows = append(rows, l)
		}
	}
	return rows
}

// The CI smoke test: two ranks, every iteration checked, files written.
func TestBenchLocal2Check(t *testing.T) {
	dir := t.TempDir()
	jsonPath, plotPath := filepath.Join(dir, "bench.json"), filepath.Join(dir, "bench.png")
	r := halod(t, nil, "bench", "--local", "2", "--check", "--max-bytes", "64K", "--warmup", "2", "--iters", "20",
		"--json", jsonPath, "--plot", plotPath)
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	rows := dataLines(r.stdout)
	if len(rows) != 2*14 { // 8 B .. 64 KiB, forward and backward
		t.Errorf("%d rows, want 28:\n%s", len(rows), r.stdout)
	}
	for _, want := range []string{"#wrong", "busbw", "2 ranks (local)", "# Result             : PASS", "Avg bus bandwidth", "# binding: rank r on CPU"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, r.stdout)
		}
	}
	for _, row := range rows {
		f := strings.Fields(row)
		if len(f) != 10 || f[9] != "0" || f[4] != "20" {
			t.Errorf("row %q: want 10 columns, 20 iterations, 0 wrong", row)
		}
	}
	// Logs go to stderr, whatever it is: stdout is the table alone.
	if !strings.Contains(r.stderr, "wrote results") || strings.Contains(r.stdout, `"level"`) {
		t.Errorf("the log lines are not on stderr alone:\nstdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
	var rep benchmark.Report
	b, err := os.ReadFile(jsonPath)
	if err == nil {
		err = json.Unmarshal(b, &rep)
	}
	if err != nil || len(rep.Rows) != 28 || rep.Summary.Verdict != "PASS" || rep.Meta.WorldSize != 2 {
		t.Errorf("json: %v: %d rows, summary %+v", err, len(rep.Rows), rep.Summary)
	}
	if png, err := os.ReadFile(plotPath); err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
		t.Errorf("plot: %v", err)
	}
}

// A multi-hop halo (shard of 1 slice, halo of 2) in bfloat16 over three
// separate tensors, from the environment.
func TestBenchShapeFromEnvironment(t *testing.T) {
	r := halod(t, []string{"HALO_BENCH_SHAPE=2x1x3x8", "HALO_BENCH_DIM=1", "HALO_BENCH_LEFT=2", "HALO_BENCH_RIGHT=1",
		"HALO_BENCH_DTYPE=bf16", "HALO_BENCH_CHECK=1", "HALO_BENCH_ITERS=10", "HALO_BENCH_IN_PLACE=false", "HALO_BENCH_LOCAL=3"}, "bench")
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	rows := dataLines(r.stdout)
	// size: the larger side, 2 slices of 2x3x8 bfloat16.
	if len(rows) != 2 || !strings.HasPrefix(strings.TrimSpace(rows[0]), "192 ") || !strings.Contains(rows[0], "bfloat16") {
		t.Errorf("rows:\n%s", r.stdout)
	}
	if !strings.Contains(r.stdout, "x 2x1x3x8 bfloat16 per rank, dim 1, left 2 right 1") || !strings.Contains(r.stdout, "PASS") {
		t.Errorf("output:\n%s", r.stdout)
	}
}

// --stream on a CPU: every exchange ordered on a stream of the host
// emulation of the CUDA driver by the communicator's proxy, checked, and
// the header says so.
func TestBenchStreamHostFake(t *testing.T) {
	r := halod(t, []string{"HALO_CUDA_DRIVER=host-fake"}, "bench", "--local", "2", "--stream", "--check",
		"--min-bytes", "2K", "--max-bytes", "2M", "--step-factor", "1024", "--warmup", "2", "--iters", "20")
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	if rows := dataLines(r.stdout); len(rows) != 4 {
		t.Errorf("%d rows, want 4 (2 KiB and 2 MiB, forward and backward):\n%s", len(rows), r.stdout)
	}
	for _, want := range []string{"stream-ordered", "host-fake driver", "# Result             : PASS"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("output lacks %q:\n%s", want, r.stdout)
		}
	}
}

// Ranks from a launcher's variables: rank 0 of 2 whose peer never comes
// fails at its deadline, naming the missing rank.
func TestBenchMissingRank(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	r := halod(t, []string{"RANK=0", "WORLD_SIZE=2", "HALO_RENDEZVOUS=" + addr}, "bench", "--bootstrap-timeout", "2s", "--log-format", "json")
	if r.code != 1 {
		t.Fatalf("exit %d, want 1\nstderr:\n%s", r.code, r.stderr)
	}
	if !strings.Contains(r.stderr, "rank 1 of 2 did not") || !strings.Contains(r.stderr, `"level":"error"`) {
		t.Errorf("stderr does not name the missing rank:\n%s", r.stderr)
	}
	if r.took > 20*time.Second {
		t.Errorf("took %v", r.took)
	}
}

// A rank that dies mid-run fails the run at once, with a message that
// names it, and no rank is left behind.
func TestBenchRankKilled(t *testing.T) {
	b := startHalod(t, nil, "bench", "--local", "2", "--log-level", "debug", "--log-format", "json",
		"-b", "8", "-e", "8", "--iters", "10000000", "--warmup", "0", "--timeout", "30s")
	started := regexp.MustCompile(`"rank":1,"pid":(\d+),.*"message":"started rank"`)
	var pid int
	deadline := time.Now().Add(20 * time.Second)
	for pid == 0 && time.Now().Before(deadline) {
		if m := started.FindStringSubmatch(b.stderr.String()); m != nil {
			pid, _ = strconv.Atoi(m[1])
		}
		time.Sleep(20 * time.Millisecond)
	}
	if pid == 0 {
		t.Fatalf("no pid for rank 1 in:\n%s", b.stderr.String())
	}
	r0 := regexp.MustCompile(`"rank":0,"pid":(\d+)`).FindStringSubmatch(b.stderr.String())
	time.Sleep(500 * time.Millisecond) // let the exchange start
	syscall.Kill(pid, syscall.SIGKILL)
	start := time.Now()
	if code := b.wait(t, 15*time.Second); code != 1 {
		t.Errorf("exit status %d, want 1", code)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the run took %v to fail", took)
	}
	if !strings.Contains(b.stderr.String(), "rank 1 (pid "+strconv.Itoa(pid)+") died of a signal: killed") {
		t.Errorf("stderr does not name the killed rank:\n%s", lastN(b.stderr.String(), 10))
	}
	if r0 != nil {
		p, _ := strconv.Atoi(r0[1])
		if syscall.Kill(p, 0) == nil {
			exec.Command("kill", "-9", r0[1]).Run()
			t.Errorf("rank 0 (pid %d) outlived the run", p)
		}
	}
}

func lastN(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func TestBenchComparePerftest(t *testing.T) {
	if _, err := exec.LookPath("ucx_perftest"); err != nil {
		t.Skip("ucx_perftest is not installed")
	}
	r := halod(t, nil, "bench", "--local", "2", "-b", "2K", "-e", "2K", "--op", "forward", "--iters", "200", "--compare-perftest")
	if r.code != 0 {
		t.Fatalf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
	}
	rows := dataLines(r.stdout)
	if len(rows) != 1 || strings.Count(rows[0], "x") != 2 || strings.Contains(rows[0], "failed") {
		t.Errorf("want one row with two ratios:\n%s\nstderr:\n%s", r.stdout, r.stderr)
	}
	if !strings.Contains(r.stdout, "vs ucx_perftest") {
		t.Errorf("no comparison in the footer:\n%s", r.stdout)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Two ranks started as a launcher would start them: Open MPI's variables,
// rank 0 hosting the rendezvous; only rank 0 prints the table.
func TestBenchUnderALauncher(t *testing.T) {
	addr := freeAddr(t)
	common := []string{"OMPI_COMM_WORLD_SIZE=2", "OMPI_COMM_WORLD_LOCAL_SIZE=2", "HALO_RENDEZVOUS=" + addr}
	args := []string{"bench", "--check", "-b", "1K", "-e", "4K", "--iters", "10"}
	r1 := startHalod(t, append(common, "OMPI_COMM_WORLD_RANK=1"), args...)
	r0 := halod(t, append(common, "OMPI_COMM_WORLD_RANK=0"), args...)
	if r0.code != 0 {
		t.Fatalf("rank 0: exit %d\n%s\n%s", r0.code, r0.stdout, r0.stderr)
	}
	if code := r1.wait(t, 20*time.Second); code != 0 {
		t.Errorf("rank 1: exit %d\n%s", code, r1.stderr.String())
	}
	if len(dataLines(r0.stdout)) != 6 || !strings.Contains(r0.stdout, "2 ranks (openmpi)") || !strings.Contains(r0.stdout, "PASS") {
		t.Errorf("rank 0's table:\n%s", r0.stdout)
	}
	if out := r1.stdout.String(); out != "" {
		t.Errorf("rank 1 printed:\n%s", out)
	}
}

// The ranks of two jobs meet at one halod serve.
func TestBenchThroughHalodServe(t *testing.T) {
	srv, addr := startServe(t, nil)
	env := func(job string, rank int) []string {
		return []string{"HALO_TOKEN=" + serveToken, "HALO_RENDEZVOUS=" + addr, "HALO_RENDEZVOUS_EXTERNAL=1",
			"HALO_JOB_ID=" + job, "RANK=" + strconv.Itoa(rank), "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2"}
	}
	args := []string{"bench", "--check", "-b", "64", "-e", "64", "--iters", "5", "--op", "forward"}
	var others []*background
	for _, job := range []string{"a", "b"} {
		others = append(others, startHalod(t, env(job, 1), args...))
	}
	for _, job := range []string{"a", "b"} {
		r := halod(t, env(job, 0), args...)
		if r.code != 0 || !strings.Contains(r.stdout, "2 ranks (torchrun)") || len(dataLines(r.stdout)) != 1 {
			t.Errorf("job %s rank 0: exit %d\n%s\n%s", job, r.code, r.stdout, r.stderr)
		}
	}
	for i, b := range others {
		if code := b.wait(t, 20*time.Second); code != 0 {
			t.Errorf("rank 1 of job %d: exit %d\n%s", i, code, b.stderr.String())
		}
	}
	srv.stderr.waitLog(t, "job complete")
}

// repeatsPrefix reports whether msg holds the same words twice in a row
// between colons, as "rendezvous failed: rendezvous failed: ...".
func repeatsPrefix(msg string) bool {
	parts := strings.Split(msg, ": ")
	for i := 1; i < len(parts); i++ {
		if strings.TrimSpace(parts[i]) == strings.TrimSpace(parts[i-1]) {
			return true
		}
	}
	return false
}

// Failures say what failed once: no message repeats its prefix.
func TestMessagesSayTheirPrefixOnce(t *testing.T) {
	closed := freeAddr(t)
	for _, tc := range []struct {
		env  []string
		args []string
		want string
	}{
		{[]string{"HALO_RENDEZVOUS=" + closed, "HALO_RENDEZVOUS_EXTERNAL=1", "HALO_JOB_ID=prefix-once"},
			[]string{"bench", "--rank", "1", "--world-size", "2", "--bootstrap-timeout", "1s"}, "could not reach"},
		{[]string{"HALO_RENDEZVOUS=192.0.2.1:29700"}, []string{"bench", "--rank", "1", "--world-size", "2"}, "token is required"},
		{[]string{"HALO_TIMEOUT_MS=soon"}, []string{"bench", "--local", "2"}, "HALO_TIMEOUT_MS"},
		{[]string{"MASTER_ADDR=127.0.0.1", "MASTER_PORT=http", "RANK=0", "WORLD_SIZE=2"}, []string{"bench"}, "MASTER_PORT"},
	} {
		r := halod(t, tc.env, append(tc.args, "--log-format", "json")...)
		if r.code == 0 || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%v %v: exit %d, want a failure naming %q:\n%s", tc.env, tc.args, r.code, tc.want, r.stderr)
		}
		for _, line := range strings.Split(strings.TrimSpace(r.stderr), "\n") {
			var m map[string]any
			msg := line
			if json.Unmarshal([]byte(line), &m) == nil {
				msg = fmt.Sprint(m["error"])
			}
			if repeatsPrefix(msg) {
				t.Errorf("%v %v: %q repeats its prefix", tc.env, tc.args, msg)
			}
		}
	}
}

// --local with HALO_RENDEZVOUS_EXTERNAL: the local ranks meet at the given
// halod serve (with its token), not at a private rendezvous; a wrong token
// is refused there.
func TestBenchLocalUsesTheSharedService(t *testing.T) {
	srv, addr := startServe(t, nil)
	env := []string{"HALO_RENDEZVOUS=" + addr, "HALO_RENDEZVOUS_EXTERNAL=1", "HALO_JOB_ID=shared-local"}
	args := []string{"bench", "--local", "2", "--check", "-b", "64", "-e", "64", "--iters", "5", "--op", "forward", "--bootstrap-timeout", "10s"}
	r := halod(t, append(env, "HALO_TOKEN="+serveToken), args...)
	if r.code != 0 || !strings.Contains(r.stdout, "PASS") {
		t.Fatalf("exit %d\n%s\n%s", r.code, r.stdout, r.stderr)
	}
	if m := srv.stderr.waitLog(t, "job complete"); m["job"] != "shared-local" {
		t.Errorf("halod serve saw %v, not job shared-local", m)
	}
	r = halod(t, append(env, "HALO_TOKEN=wrong"), args...)
	if r.code != 1 || !strings.Contains(r.stderr, "rejected the token") {
		t.Errorf("wrong token: exit %d\n%s", r.code, r.stderr)
	}
	// Without EXTERNAL, rank 0 hosts at HALO_RENDEZVOUS itself.
	own := freeAddr(t)
	r = halod(t, []string{"HALO_RENDEZVOUS=" + own}, append(args, "--log-level", "debug", "--log-format", "json")...)
	if r.code != 0 || !strings.Contains(r.stderr, `"rendezvous":"`+own+`"`) {
		t.Errorf("--local with HALO_RENDEZVOUS=%s: exit %d\n%s", own, r.code, r.stderr)
	}
}

// Under torchrun the rendezvous is MASTER_ADDR at MASTER_PORT+1: torchrun's
// own store holds MASTER_PORT.
func TestBenchTorchrunMasterPort(t *testing.T) {
	free := freeAddr(t)
	_, p, _ := net.SplitHostPort(free)
	port, _ := strconv.Atoi(p)
	master := strconv.Itoa(port - 1)
	env := func(rank int) []string {
		return []string{"RANK=" + strconv.Itoa(rank), "WORLD_SIZE=2", "LOCAL_RANK=" + strconv.Itoa(rank), "LOCAL_WORLD_SIZE=2",
			"MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + master}
	}
	args := []string{"bench", "--check", "-b", "64", "-e", "64", "--iters", "5", "--op", "forward", "--log-level", "debug", "--log-format", "json"}
	r1 := startHalod(t, env(1), args...)
	r0 := halod(t, env(0), args...)
	if r0.code != 0 || !strings.Contains(r0.stdout, "2 ranks (torchrun)") {
		t.Fatalf("rank 0: exit %d\n%s\n%s", r0.code, r0.stdout, r0.stderr)
	}
	if !strings.Contains(r0.stderr, `"rendezvous":"127.0.0.1:`+p+`"`) {
		t.Errorf("rank 0 did not host at MASTER_PORT+1 = %s:\n%s", p, r0.stderr)
	}
	if code := r1.wait(t, 20*time.Second); code != 0 {
		t.Errorf("rank 1: exit %d\n%s", code, r1.stderr.String())
	}
}
