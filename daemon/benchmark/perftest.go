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

// freePort returns a TCP port free on host ("" for every interface).
func freePort(host string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
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
		port, err := freePort("127.0.0.1")
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
	var srvCPU, cliCPU []string
	if len(cpus) >= 2 {
		srvCPU = []string{"-c", strconv.Itoa(cpus[0])}
		cliCPU = []string{"-c", strconv.Itoa(cpus[1])}
	}
	srv, err := startPerftestServer(ctx, exe, port, srvCPU)
	if err != nil {
		return perftestLine{}, err
	}
	defer srv.stop()
	return perftestClient(ctx, exe, "127.0.0.1", port, test, size, iters, warmup, perftestTimeout(size, iters, warmup), cliCPU, log)
}

// perftestServer is a running ucx_perftest server, listening.
type perftestServer struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// startPerftestServer starts ucx_perftest's server on port (every
// interface) and returns once it listens.
func startPerftestServer(ctx context.Context, exe string, port int, extra []string) (*perftestServer, error) {
	srv := exec.Command(exe, append([]string{"-p", strconv.Itoa(port)}, extra...)...)
	srv.Env = os.Environ()
	srv.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var srvOut strings.Builder
	srv.Stdout, srv.Stderr = &limitedWriter{b: &srvOut, n: 4096}, &limitedWriter{b: &srvOut, n: 4096}
	if err := srv.Start(); err != nil {
		return nil, fmt.Errorf("starting the ucx_perftest server: %w", err)
	}
	s := &perftestServer{cmd: srv, done: make(chan struct{})}
	go func() { srv.Wait(); close(s.done) }()

	// Wait for the server to listen before starting the client. Its
	// "Waiting for connection" line sits in a stdio buffer when its output
	// is a pipe, and a probe connection would be taken for the client, so
	// look for the listening socket instead.
	deadline := time.Now().Add(10 * time.Second)
	for !listening(port) {
		select {
		case <-s.done:
			return nil, fmt.Errorf("the ucx_perftest server on port %d exited at once: %s", port, lastLines(srvOut.String(), 3))
		case <-ctx.Done():
			s.stop()
			return nil, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("the ucx_perftest server on port %d did not start listening within 10s", port)
		}
	}
	return s, nil
}

// stop kills the server by its pid and waits for it.
func (s *perftestServer) stop() {
	s.cmd.Process.Kill()
	<-s.done
}

// perftestTimeout bounds one ucx_perftest client run.
func perftestTimeout(size int64, iters, warmup int) time.Duration {
	return 60*time.Second + time.Duration(size)*time.Duration(iters+warmup)/(100<<20)*time.Second
}

// perftestClient runs ucx_perftest's client against the server at
// host:port, for at most timeout, and parses its result.
func perftestClient(ctx context.Context, exe, host string, port int, test string, size int64, iters, warmup int, timeout time.Duration, extra []string, log zerolog.Logger) (perftestLine, error) {
	cctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	args := []string{host, "-p", strconv.Itoa(port), "-t", test, "-s", strconv.FormatInt(size, 10),
		"-n", strconv.Itoa(iters), "-w", strconv.Itoa(warmup), "-f"}
	args = append(args, extra...)
	cli := exec.CommandContext(cctx, exe, args...)
	cli.Env = os.Environ()
	cli.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	log.Debug().Str("test", test).Int64("bytes", size).Int("iters", iters).Str("server", net.JoinHostPort(host, strconv.Itoa(port))).Msg("running ucx_perftest")
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

// perftestHostLen bounds the host name rank 0 sends rank 1.
const perftestHostLen = 256

// perftestAcrossIters chooses iteration counts for ucx_perftest between
// hosts: about 64 MiB moved by tag_lat and 256 MiB by tag_bw, so that a
// slow network still finishes each test in seconds.
func perftestAcrossIters(test string, size int64) (iters, warmup int) {
	budget, lo, hi := int64(64<<20), int64(20), int64(2000)
	if test == "tag_bw" {
		budget, lo, hi = 256<<20, 10, 5000
	}
	n := min(max(budget/max(size, 1), lo), hi)
	return int(n), int(max(n/10, 2))
}

// runPerftestAcross measures tag_lat and tag_bw at every size between rank
// 0, which runs ucx_perftest's server, and rank 1, its client, connecting to
// rank 0's host: the figures of the network the ranks use. Every rank of
// the job takes part (the others only in the bookkeeping); rank 0 returns
// the results. A size that fails is reported in its Error, as in
// RunPerftest; ucx_perftest missing on rank 0 or 1 fails every rank. wait
// is the ranks' exchange deadline: a client run must end well within it,
// since the other ranks wait for its result.
func runPerftestAcross(ctx context.Context, k *collective, path, rendezvous string, sizes []int64, wait time.Duration, log zerolog.Logger, progress func(done int)) ([]PerftestResult, error) {
	if path == "" {
		path = "ucx_perftest"
	}
	exe, lookErr := exec.LookPath(path)
	missing := []float64{0}
	if lookErr != nil && k.rank <= 1 {
		missing[0] = float64(k.rank + 1)
	}
	if err := k.allreduce(missing, maxf); err != nil {
		return nil, err
	}
	if missing[0] > 0 {
		return nil, fmt.Errorf("ucx_perftest (%s) not found on rank %d: install UCX's tools (Debian: ucx-utils) or pass --perftest-path", path, int(missing[0])-1)
	}
	host := ""
	if k.rank == 0 {
		host = perftestHost(rendezvous)
		log.Debug().Str("host", host).Msg("ucx_perftest server address for rank 1")
	}
	var out []PerftestResult
	for i, size := range sizes {
		res := PerftestResult{Bytes: size}
		var failed []string
		for _, test := range []string{"tag_lat", "tag_bw"} {
			iters, warmup := perftestAcrossIters(test, size)
			limit := min(perftestTimeout(size, iters, warmup), wait*3/4)
			value, err := perftestAcrossOnce(ctx, k, exe, host, test, size, iters, warmup, limit, log)
			var pe perftestError
			switch {
			case errors.As(err, &pe):
				failed = append(failed, err.Error())
				continue
			case err != nil:
				return nil, err
			}
			if test == "tag_lat" {
				res.LatencyUS, res.LatIters = value, iters
			} else {
				res.BWGBs, res.BWIters = value*(1<<20)/1e9, iters
			}
		}
		if len(failed) > 0 {
			res.Error = strings.Join(failed, "; ")
			if k.rank == 0 {
				log.Warn().Str("error", res.Error).Int64("bytes", size).Msg("ucx_perftest failed at this size")
			}
		}
		out = append(out, res)
		if progress != nil {
			progress(i + 1)
		}
	}
	if k.rank != 0 {
		return nil, nil
	}
	return out, nil
}

// perftestError is a failed ucx_perftest run, reported in its row; other
// errors (the ranks' own exchanges) end the benchmark.
type perftestError struct{ error }

// perftestAcrossOnce runs one server (rank 0) and client (rank 1) pair and
// returns, on rank 0, tag_lat's median latency (us) or tag_bw's overall
// bandwidth (MiB/s).
func perftestAcrossOnce(ctx context.Context, k *collective, exe, host, test string, size int64, iters, warmup int, limit time.Duration, log zerolog.Logger) (float64, error) {
	// Rank 0 to everyone: [ok, port, len(host), host...].
	msg := make([]float64, 3+perftestHostLen)
	var srvErr error
	if k.rank == 0 {
		port, err := freePort("")
		var srv *perftestServer
		if err == nil {
			srv, err = startPerftestServer(ctx, exe, port, nil)
		}
		if err != nil {
			srvErr = err
		} else {
			defer srv.stop()
			msg[0], msg[1], msg[2] = 1, float64(port), float64(min(len(host), perftestHostLen))
			for j := 0; j < int(msg[2]); j++ {
				msg[3+j] = float64(host[j])
			}
		}
	}
	if err := k.broadcast(msg); err != nil {
		return 0, err
	}
	// Rank 1 to rank 0: [1 and the figure, or -1].
	res := []float64{0, 0}
	if k.rank == 1 && msg[0] == 1 {
		b := make([]byte, int(msg[2]))
		for j := range b {
			b[j] = byte(msg[3+j])
		}
		line, err := perftestClient(ctx, exe, string(b), int(msg[1]), test, size, iters, warmup, limit, nil, log)
		switch {
		case err != nil:
			log.Warn().Err(err).Str("test", test).Int64("bytes", size).Msg("ucx_perftest client failed")
			res[0] = -1
		case test == "tag_lat":
			res[0], res[1] = 1, line.latP50
		default:
			res[0], res[1] = 1, line.bwOverallMiBs
		}
	}
	if err := k.reduce(res, sumf); err != nil {
		return 0, err
	}
	switch {
	case k.rank != 0:
		return 0, nil
	case srvErr != nil:
		return 0, perftestError{srvErr}
	case res[0] != 1:
		return 0, perftestError{fmt.Errorf("ucx_perftest %s client on rank 1 against %s failed (rank 1's log says why)", test, host)}
	}
	return res[1], nil
}

// perftestHost is the address rank 1 reaches rank 0's ucx_perftest server
// at: the address of the first device UCX_NET_DEVICES names, else the
// address this host reaches the rendezvous from (loopback when the
// rendezvous is on loopback), else the host name.
func perftestHost(rendezvous string) string {
	for _, dev := range strings.Split(os.Getenv("UCX_NET_DEVICES"), ",") {
		name, _, _ := strings.Cut(strings.TrimSpace(dev), ":")
		if name == "" || name == "all" {
			continue
		}
		if ifc, err := net.InterfaceByName(name); err == nil {
			if addrs, err := ifc.Addrs(); err == nil {
				for _, a := range addrs {
					if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
						return ipn.IP.String()
					}
				}
			}
		}
	}
	if c, err := net.Dial("udp", rendezvous); err == nil {
		defer c.Close()
		if a, ok := c.LocalAddr().(*net.UDPAddr); ok {
			return a.IP.String()
		}
	}
	h, _ := os.Hostname()
	return h
}
