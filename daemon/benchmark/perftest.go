package benchmark

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"
)

// perftestCPUs returns the CPUs of the server and the client: those of
// ranks 0 and 1 when the ranks were bound, none otherwise.
func perftestCPUs(rankCPUs []int) []int {
	if len(rankCPUs) < 2 {
		return nil
	}
	return rankCPUs[:2]
}

// PerftestResult is ucx_perftest's figures at one message size: tag_lat's
// median latency (one-way: half of a ping-pong round trip) and tag_bw's
// overall bandwidth (one sender streaming to one receiver), both between two
// processes on this machine over whatever UCX_TLS allows.
type PerftestResult struct {
	Bytes     int64   `json:"bytes"`
	LatencyUS float64 `json:"tag_lat_p50_us"`
	LatIters  int     `json:"tag_lat_iters"`
	BWGBs     float64 `json:"tag_bw_gbs"` // GB = 1e9 bytes
	BWIters   int     `json:"tag_bw_iters"`
	Error     string  `json:"error,omitempty"`
}

// perftestIters chooses iteration counts that keep each test short: about
// 1 GiB moved by tag_lat and 4 GiB by tag_bw, within sensible bounds.
func perftestIters(test string, size int64) (iters, warmup int) {
	budget, lo, hi := int64(1<<30), int64(20), int64(20000)
	if test == "tag_bw" {
		budget, lo, hi = 4<<30, 10, 100000
	}
	n := min(max(budget/max(size, 1), lo), hi)
	return int(n), int(max(n/10, 2))
}

// RunPerftest measures tag_lat and tag_bw at every size with ucx_perftest,
// one server and one client on this machine per measurement, in the
// environment of this process (so with its UCX_TLS), bound to cpus[0] and
// cpus[1] when given. A size that fails is reported in its Error and the
// others still run; a missing ucx_perftest is an error.
func RunPerftest(ctx context.Context, path string, sizes []int64, cpus []int, log zerolog.Logger, progress func(done int)) ([]PerftestResult, error) {
	if path == "" {
		path = "ucx_perftest"
	}
	exe, err := exec.LookPath(path)
	if err != nil {
		return nil, fmt.Errorf("ucx_perftest not found (%v): install UCX's tools (Debian: ucx-utils) or pass --perftest-path", err)
	}
	out := make([]PerftestResult, len(sizes))
	for i, size := range sizes {
		out[i].Bytes = size
		lat, n, err := perftestOnce(ctx, exe, "tag_lat", size, cpus, log)
		if err == nil {
			out[i].LatencyUS, out[i].LatIters = lat.latP50, n
			var bw perftestLine
			bw, n, err = perftestOnce(ctx, exe, "tag_bw", size, cpus, log)
			if err == nil {
				out[i].BWGBs, out[i].BWIters = bw.bwOverallMiBs*(1<<20)/1e9, n
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			out[i].Error = err.Error()
			log.Warn().Err(err).Int64("bytes", size).Msg("ucx_perftest failed at this size")
		}
		if progress != nil {
			progress(i + 1)
		}
	}
	return out, nil
}

// perftestLine is the final line of ucx_perftest -f.
type perftestLine struct {
	iters                      int
	latP50, latAvg, latOverall float64 // us
	bwAvgMiBs, bwOverallMiBs   float64 // "MB/s" in its header, 2^20 bytes
	rateAvg, rateOverall       float64
}

func parsePerftest(output string) (perftestLine, error) {
	var last []float64
	for _, line := range strings.Split(output, "\n") {
		f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "Final:"))
		if len(f) != 8 {
			continue
		}
		nums := make([]float64, 8)
		ok := true
		for i, s := range f {
			v, err := strconv.ParseFloat(strings.ReplaceAll(s, ",", ""), 64)
			if err != nil {
				ok = false
				break
			}
			nums[i] = v
		}
		if ok {
			last = nums
		}
	}
	if last == nil {
		return perftestLine{}, errors.New("no result line in ucx_perftest's output")
	}
	return perftestLine{iters: int(last[0]), latP50: last[1], latAvg: last[2], latOverall: last[3],
		bwAvgMiBs: last[4], bwOverallMiBs: last[5], rateAvg: last[6], rateOverall: last[7]}, nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// perftestOnce runs one server/client pair. The server is killed by its
// pid whatever happens.
func perftestOnce(ctx context.Context, exe, test string, size int64, cpus []int, log zerolog.Logger) (perftestLine, int, error) {
	iters, warmup := perftestIters(test, size)
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		port, err := freePort()
		if err != nil {
			return perftestLine{}, 0, err
		}
		res, err := perftestPair(ctx, exe, port, test, size, iters, warmup, cpus, log)
		if err == nil {
			return res, iters, nil
		}
		lastErr = err
		if ctx.Err() != nil {
			break
		}
	}
	return perftestLine{}, 0, lastErr
}

func perftestPair(ctx context.Context, exe string, port int, test string, size int64, iters, warmup int, cpus []int, log zerolog.Logger) (perftestLine, error) {
	srvArgs := []string{"-p", strconv.Itoa(port)}
	var cliCPU []string
	if len(cpus) >= 2 {
		srvArgs = append(srvArgs, "-c", strconv.Itoa(cpus[0]))
		cliCPU = []string{"-c", strconv.Itoa(cpus[1])}
	}
	srv := exec.Command(exe, srvArgs...)
	srv.Env = os.Environ()
	srv.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var srvOut strings.Builder
	srv.Stdout, srv.Stderr = &limitedWriter{b: &srvOut, n: 4096}, &limitedWriter{b: &srvOut, n: 4096}
	if err := srv.Start(); err != nil {
		return perftestLine{}, fmt.Errorf("starting the ucx_perftest server: %w", err)
	}
	srvDone := make(chan struct{})
	go func() { srv.Wait(); close(srvDone) }()
	defer func() {
		srv.Process.Kill()
		<-srvDone
	}()

	// Wait for the server to listen before starting the client. Its
	// "Waiting for connection" line sits in a stdio buffer when its output
	// is a pipe, and a probe connection would be taken for the client, so
	// look for the listening socket instead.
	deadline := time.Now().Add(10 * time.Second)
	for !listening(port) {
		select {
		case <-srvDone:
			return perftestLine{}, fmt.Errorf("the ucx_perftest server on port %d exited at once: %s", port, lastLines(srvOut.String(), 3))
		case <-ctx.Done():
			return perftestLine{}, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return perftestLine{}, fmt.Errorf("the ucx_perftest server on port %d did not start listening within 10s", port)
		}
	}

	timeout := 60*time.Second + time.Duration(size)*time.Duration(iters+warmup)/(100<<20)*time.Second
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	args := []string{"127.0.0.1", "-p", strconv.Itoa(port), "-t", test, "-s", strconv.FormatInt(size, 10),
		"-n", strconv.Itoa(iters), "-w", strconv.Itoa(warmup), "-f"}
	args = append(args, cliCPU...)
	cli := exec.CommandContext(cctx, exe, args...)
	cli.Env = os.Environ()
	cli.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	log.Debug().Str("test", test).Int64("bytes", size).Int("iters", iters).Int("port", port).Msg("running ucx_perftest")
	b, err := cli.CombinedOutput()
	if err != nil {
		return perftestLine{}, fmt.Errorf("ucx_perftest %s: %v: %s", strings.Join(args, " "), err, lastLines(string(b), 3))
	}
	res, err := parsePerftest(string(b))
	if err != nil {
		return perftestLine{}, fmt.Errorf("ucx_perftest %s: %v: %s", strings.Join(args, " "), err, lastLines(string(b), 3))
	}
	return res, nil
}

// listening reports whether some socket listens on TCP port (Linux's
// /proc/net/tcp and tcp6, state 0A).
func listening(port int) bool {
	want := fmt.Sprintf(":%04X", port)
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			fs := strings.Fields(line)
			if len(fs) > 3 && strings.HasSuffix(fs[1], want) && fs[3] == "0A" {
				return true
			}
		}
	}
	return false
}

type limitedWriter struct {
	b *strings.Builder
	n int
}

func (w *limitedWriter) Write(p []byte) (int, error) {
	if room := w.n - w.b.Len(); room > 0 {
		w.b.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
