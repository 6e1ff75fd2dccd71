package cli

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/daemon/benchmark"
	"github.com/halo-cp/halo/daemon/launch"
	"github.com/halo-cp/halo/rendezvous"
	"github.com/rs/zerolog"
	ucli "github.com/urfave/cli/v2"
)

// maxLocalRanks bounds --local: every rank is a process on this machine.
const maxLocalRanks = 256

// benchRankEnv carries a --local rank's configuration from halod bench to
// the copy of itself it starts for that rank.
const benchRankEnv = "HALO_BENCH_RANK_CONFIG"

func benchFlags() []ucli.Flag {
	d := benchmark.Defaults()
	return []ucli.Flag{
		&ucli.IntFlag{Name: "local", EnvVars: []string{"HALO_BENCH_LOCAL"},
			Usage: "start `N` ranks on this machine (without it, ranks come from the launcher: torchrun, mpirun, srun)"},
		&ucli.StringFlag{Name: "bind", Value: "auto", EnvVars: []string{"HALO_BENCH_BIND"},
			Usage: "pin each rank to a CPU: cpu (round robin over the CPUs this process may use, by local rank), none, or auto (cpu with --local and under torchrun when the ranks fit the CPUs; none under mpirun or srun, which bind their ranks)"},
		// Workload.
		&ucli.GenericFlag{Name: "min-bytes", Aliases: []string{"b"}, Value: ptr(byteSize(d.MinBytes)), EnvVars: []string{"HALO_BENCH_MIN_BYTES"},
			Usage: "smallest halo of the sweep, per side (8, 2K, 1M, ...)"},
		&ucli.GenericFlag{Name: "max-bytes", Aliases: []string{"e"}, Value: ptr(byteSize(d.MaxBytes)), EnvVars: []string{"HALO_BENCH_MAX_BYTES"},
			Usage: "largest halo of the sweep, per side"},
		&ucli.Int64Flag{Name: "step-factor", Aliases: []string{"f"}, Value: d.StepFactor, EnvVars: []string{"HALO_BENCH_STEP_FACTOR"},
			Usage: "multiply the size by this from one row to the next"},
		&ucli.StringFlag{Name: "shape", EnvVars: []string{"HALO_BENCH_SHAPE"},
			Usage: "each rank's tensor `AxBx...` instead of a sweep, e.g. 1x128x16x64x64 (with --dim, --left, --right)"},
		&ucli.IntFlag{Name: "dim", Value: d.Dim, EnvVars: []string{"HALO_BENCH_DIM"},
			Usage: "the sharded dim of --shape (the sequence or time axis)"},
		&ucli.Int64Flag{Name: "left", Value: d.Left, EnvVars: []string{"HALO_BENCH_LEFT"},
			Usage: "halo slices before each shard (with --shape); in a sweep, 0 or 1: whether there is a left halo"},
		&ucli.Int64Flag{Name: "right", Value: d.Right, EnvVars: []string{"HALO_BENCH_RIGHT"},
			Usage: "halo slices after each shard (with --shape); in a sweep, 0 or 1: whether there is a right halo"},
		&ucli.StringFlag{Name: "dtype", Aliases: []string{"d"}, Value: d.DType, EnvVars: []string{"HALO_BENCH_DTYPE"},
			Usage: "element type: float32, float64, float16 or bfloat16 (f32, f64, fp16, bf16)"},
		&ucli.StringFlag{Name: "padding", Value: d.Padding, EnvVars: []string{"HALO_BENCH_PADDING"},
			Usage: "what fills the halo slots beyond the sequence's ends: zeros, replicate, reflect or circular (torch's padding_mode)"},
		&ucli.StringFlag{Name: "op", Aliases: []string{"o"}, Value: "both", EnvVars: []string{"HALO_BENCH_OP"},
			Usage: "forward, backward, or both (each timed on its own, a row each)"},
		boolFlag{&ucli.BoolFlag{Name: "in-place", Value: d.InPlace, EnvVars: []string{"HALO_BENCH_IN_PLACE"},
			Usage: "x is the interior of out (no interior copy); --in-place=false times separate tensors"}},
		&ucli.GenericFlag{Name: "transfer", Value: ptr(transfer(d.Transfer)), EnvVars: []string{comm.SettingTransfer.Env},
			Usage: comm.SettingTransfer.Means},
		boolFlag{&ucli.BoolFlag{Name: "stream", EnvVars: []string{"HALO_BENCH_STREAM"},
			Usage: "time the stream-ordered path: each exchange ordered on a CUDA stream by the communicator's proxy and waited for on the host (on a CPU: HALO_CUDA_DRIVER=host-fake)"}},
		// Timing.
		&ucli.IntFlag{Name: "warmup", Aliases: []string{"w"}, Value: d.Warmup, EnvVars: []string{"HALO_BENCH_WARMUP"},
			Usage: "untimed iterations before each op at each size"},
		&ucli.IntFlag{Name: "iters", Aliases: []string{"n"}, Value: d.Iters, EnvVars: []string{"HALO_BENCH_ITERS"},
			Usage: "timed iterations per size; 0: as many as fit in --duration"},
		&ucli.GenericFlag{Name: "duration", Value: ptr(millis(d.Duration)), EnvVars: []string{"HALO_BENCH_DURATION"},
			Usage: "time budget for each op at each size, when --iters is 0"},
		&ucli.IntFlag{Name: "min-iters", Value: d.MinIters, EnvVars: []string{"HALO_BENCH_MIN_ITERS"},
			Usage: "fewest timed iterations per size under --duration"},
		&ucli.IntFlag{Name: "max-iters", Value: d.MaxIters, EnvVars: []string{"HALO_BENCH_MAX_ITERS"},
			Usage: "most timed iterations per size under --duration"},
		boolFlag{&ucli.BoolFlag{Name: "check", Aliases: []string{"c"}, EnvVars: []string{"HALO_BENCH_CHECK"},
			Usage: "verify the data on every rank, in iterations of their own after the timed ones (#wrong; exit status 3 if any is wrong)"}},
		&ucli.IntFlag{Name: "check-iters", Value: d.CheckIters, EnvVars: []string{"HALO_BENCH_CHECK_ITERS"},
			Usage: "iterations --check verifies, per op at each size (untimed)"},
		// Output.
		&ucli.StringFlag{Name: "json", EnvVars: []string{"HALO_BENCH_JSON"},
			Usage: "write every row, and how the run was made, to `FILE` as JSON"},
		&ucli.StringFlag{Name: "plot", EnvVars: []string{"HALO_BENCH_PLOT"},
			Usage: "draw bandwidth and latency against size into `FILE` (.png, .svg or .pdf)"},
		boolFlag{&ucli.BoolFlag{Name: "compare-perftest", EnvVars: []string{"HALO_BENCH_COMPARE_PERFTEST"},
			Usage: "also run ucx_perftest tag_lat and tag_bw at the same sizes, and show it beside ours with the ratio"}},
		&ucli.StringFlag{Name: "perftest-path", Value: "ucx_perftest", EnvVars: []string{"HALO_BENCH_PERFTEST_PATH"},
			Usage: "the ucx_perftest program"},
		&ucli.StringFlag{Name: "progress", Value: d.Progress, EnvVars: []string{"HALO_BENCH_PROGRESS"},
			Usage: "progress bar on stderr: auto (when stderr is a terminal), on or off"},
		// Ranks.
		&ucli.IntFlag{Name: "rank", Value: -1, EnvVars: []string{"HALO_RANK"},
			Usage: "this process's rank, when no launcher sets RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID"},
		&ucli.IntFlag{Name: "world-size", EnvVars: []string{"HALO_WORLD_SIZE"},
			Usage: "the number of ranks, with --rank"},
		&ucli.StringFlag{Name: "rendezvous", EnvVars: []string{comm.SettingRendezvous.Env},
			Usage: "host:port where the ranks meet: rank 0's host (it listens there), or a halod serve with --external-rendezvous (default: MASTER_ADDR:MASTER_PORT+1 when set, as under torchrun; else " + comm.DefaultRendezvous + " on one host; with --local a private one)"},
		boolFlag{&ucli.BoolFlag{Name: "external-rendezvous", EnvVars: []string{comm.SettingRendezvousExternal.Env},
			Usage: comm.SettingRendezvousExternal.Means}},
		&ucli.StringFlag{Name: "token", EnvVars: []string{comm.SettingToken.Env},
			Usage: "the rendezvous's shared secret (needed off loopback; prefer the variable)"},
		&ucli.StringFlag{Name: "job-id", EnvVars: []string{comm.SettingJobID.Env},
			Usage: "the job's name on the rendezvous (default: the launcher's job id, else halo-bench)"},
		&ucli.StringFlag{Name: "attempt", EnvVars: []string{comm.SettingJobAttempt.Env},
			Usage: "the attempt of a restarted job (default: the launcher's restart count)"},
		&ucli.GenericFlag{Name: "timeout", Value: settingMillis(comm.SettingTimeout), EnvVars: []string{comm.SettingTimeout.Env},
			Usage: "deadline of every exchange: a rank that waits longer fails and names the peers it waited for (5s, or milliseconds)"},
		&ucli.GenericFlag{Name: "bootstrap-timeout", Value: settingMillis(comm.SettingBootstrapTimeout), EnvVars: []string{comm.SettingBootstrapTimeout.Env},
			Usage: "deadline for every rank to arrive at the rendezvous (5s, or milliseconds)"},
	}
}

func benchCommand() *ucli.Command {
	return &ucli.Command{
		Name:  "bench",
		Usage: "time the halo exchange across ranks and verify it, nccl-tests style",
		UsageText: `halod bench --local 2 --check                       2 ranks on this machine, sizes 8B..256MiB, data verified
halod bench --local 4 --max-bytes 4M --plot bench.png --json bench.json
halod bench --local 2 -b 2K -e 2M -f 1024 --compare-perftest    beside ucx_perftest, same sizes
halod bench --local 2 --shape 1x128x16x64x64 --dim 2 --left 2 --right 2 --dtype bf16
torchrun --nproc_per_node 2 -r 1 -t 1 --no_python halod bench --check -b 8 -e 64K --iters 20
    under PyTorch 1.13's torchrun (-r 1 -t 1 works around its crash on Python 3.11;
    PyTorch 2.x: torchrun --nproc-per-node 2 --no-python halod bench ...)
mpirun --allow-run-as-root --oversubscribe -np 2 halod bench --check -b 8 -e 64K --iters 20
    under Open MPI (--allow-run-as-root only as root)        srun -n 8 halod bench
HALO_RENDEZVOUS=host:29700 HALO_RENDEZVOUS_EXTERNAL=1 HALO_TOKEN=... UCX_NET_DEVICES=eth0 \
  halod bench --rank R --world-size W --check      across hosts, meeting at a halod serve

Under torchrun, rank 0 hosts the rendezvous at MASTER_ADDR:MASTER_PORT+1 (torchrun's
store holds MASTER_PORT). With several hosts, --compare-perftest runs ucx_perftest's
server on rank 0's host and its client on rank 1's.

Columns: size = halo bytes per side; time = the slowest rank's call, median
(p50) and 99th percentile over the iterations; algbw = size / p50;
busbw = bytes the busiest rank sends / p50 (GB = 1e9 bytes). Timed calls run
back to back; --check verifies the data in --check-iters iterations of their
own after them, untimed, and #wrong counts wrong values over those and every
rank (-1 without --check).
Exit status: 0 success, 1 failure, 2 bad usage, 3 wrong data.`,
		Flags:  benchFlags(),
		Action: bench,
	}
}

// benchOptions reads the flags into the benchmark's options.
func benchOptions(c *ucli.Context) (benchmark.Options, error) {
	o := benchmark.Defaults()
	var err error
	if o.Shape, err = benchmark.ParseShape(c.String("shape")); err != nil {
		return o, usagef(c, "%v", err)
	}
	if o.Shape == nil && c.IsSet("dim") && c.Int("dim") != 0 {
		return o, usagef(c, "--dim applies to --shape only")
	}
	o.Dim = c.Int("dim")
	o.Left, o.Right = c.Int64("left"), c.Int64("right")
	o.DType = c.String("dtype")
	o.Padding = c.String("padding")
	o.MinBytes = int64(*c.Generic("min-bytes").(*byteSize))
	o.MaxBytes = int64(*c.Generic("max-bytes").(*byteSize))
	if o.Shape != nil && (c.IsSet("min-bytes") || c.IsSet("max-bytes")) {
		return o, usagef(c, "--shape and --min-bytes/--max-bytes exclude each other: a shape is one size")
	}
	if c.IsSet("min-bytes") && !c.IsSet("max-bytes") && o.MinBytes > o.MaxBytes {
		o.MaxBytes = o.MinBytes
	}
	if c.IsSet("max-bytes") && !c.IsSet("min-bytes") && o.MaxBytes < o.MinBytes {
		o.MinBytes = o.MaxBytes
	}
	o.StepFactor = c.Int64("step-factor")
	if o.Ops, err = benchmark.OpsFromFlag(c.String("op")); err != nil {
		return o, usagef(c, "%v", err)
	}
	o.InPlace = c.Bool("in-place")
	o.Stream = c.Bool("stream")
	o.Transfer = c.Generic("transfer").(*transfer).String()
	o.Warmup, o.Iters = c.Int("warmup"), c.Int("iters")
	o.Duration = duration(c, "duration")
	o.MinIters, o.MaxIters = c.Int("min-iters"), c.Int("max-iters")
	o.Check, o.CheckIters = c.Bool("check"), c.Int("check-iters")
	o.JSONPath, o.PlotPath = c.String("json"), c.String("plot")
	o.ComparePerftest = c.Bool("compare-perftest")
	o.PerftestPath = c.String("perftest-path")
	o.Progress = c.String("progress")
	o.Command = append([]string{"halod"}, os.Args[1:]...)
	if _, err := o.Validate(); err != nil {
		return o, usagef(c, "%s", strings.TrimPrefix(err.Error(), benchmark.ErrOptions.Error()+": "))
	}
	return o, nil
}

// rankConfig is what a --local rank receives from the halod bench that
// started it (the token travels separately, in comm.SettingToken's variable).
type rankConfig struct {
	Rank             int               `json:"rank"`
	Size             int               `json:"size"`
	Rendezvous       string            `json:"rendezvous"`
	HostRendezvous   bool              `json:"host_rendezvous"` // rank 0 hosts it at Rendezvous
	Job              string            `json:"job"`
	Attempt          string            `json:"attempt"`
	Timeout          time.Duration     `json:"timeout_ns"`
	BootstrapTimeout time.Duration     `json:"bootstrap_timeout_ns"`
	LogLevel         string            `json:"log_level"`
	LogFormat        string            `json:"log_format"`
	Options          benchmark.Options `json:"options"`
}

func bench(c *ucli.Context) error {
	log, err := logger(c)
	if err != nil {
		return err
	}
	if c.Args().Present() {
		return usagef(c, "takes no arguments (got %q); flags go before any argument", c.Args().First())
	}
	o, err := benchOptions(c)
	if err != nil {
		return err
	}
	// Positive and bounded: millis reads them with the library's parser.
	timeout, boot := duration(c, "timeout"), duration(c, "bootstrap-timeout")
	bind := strings.ToLower(c.String("bind"))
	if bind != "auto" && bind != "cpu" && bind != "none" {
		return usagef(c, "--bind %q: want cpu, none or auto", c.String("bind"))
	}
	if n := c.Int("local"); c.IsSet("local") || n != 0 {
		if n < 1 || n > maxLocalRanks {
			return usagef(c, "--local %d: want 1 to %d ranks", n, maxLocalRanks)
		}
		if c.IsSet("rank") || c.IsSet("world-size") {
			return usagef(c, "--local starts every rank itself: drop --rank/--world-size (HALO_RANK/HALO_WORLD_SIZE)")
		}
		return benchLocal(c, log, o, n, timeout, boot, bind)
	}

	cfg := comm.Config{Token: c.String("token"), Job: c.String("job-id"), Attempt: c.String("attempt"),
		Timeout: timeout, BootstrapTimeout: boot, ExternalServer: c.Bool("external-rendezvous"), Rendezvous: c.String("rendezvous")}
	var place launch.Placement
	switch {
	case c.IsSet("rank") || c.IsSet("world-size"):
		place = launch.Placement{Launcher: "flags", Rank: c.Int("rank"), Size: c.Int("world-size"), LocalRank: -1, LocalSize: -1, Nodes: -1}
		if place.Size < 1 || place.Rank < 0 || place.Rank >= place.Size {
			return usagef(c, "--rank %d --world-size %d: give both, with 0 <= rank < world size", place.Rank, place.Size)
		}
	default:
		p, ok, err := launch.Detect(os.Getenv)
		if err != nil {
			return usagef(c, "%v", err)
		}
		if !ok {
			return usagef(c, "no ranks to run: pass --local N to start N ranks on this machine (e.g. halod bench --local 2 --check), or start halod bench under a launcher (torchrun --no_python, mpirun, srun), or give --rank and --world-size")
		}
		place = p
	}
	cfg.Rank, cfg.Size = place.Rank, place.Size
	if cfg.Job == "" {
		cfg.Job = place.JobID
	}
	if cfg.Job == "" {
		cfg.Job = "halo-bench"
	}
	if cfg.Attempt == "" {
		cfg.Attempt = place.Attempt
	}
	if cfg.Rendezvous == "" && !cfg.ExternalServer {
		_, defaultPort, _ := net.SplitHostPort(comm.DefaultRendezvous)
		master, ok, err := place.MasterRendezvous(defaultPort)
		switch {
		case err != nil:
			return usagef(c, "%v", err)
		case ok:
			// torchrun's MASTER_ADDR is rank 0's host; its store holds MASTER_PORT.
			cfg.Rendezvous = master
		case place.SingleHost() || place.Launcher == "flags" || place.Nodes < 0 && place.LocalSize < 0:
			cfg.Rendezvous = comm.DefaultRendezvous
		default:
			return usagef(c, "the ranks run on several hosts: set --rendezvous (%s) to host:port on rank 0's host, or MASTER_ADDR (and MASTER_PORT: the rendezvous takes MASTER_PORT+1), and a --token (%s)",
				comm.SettingRendezvous.Env, comm.SettingToken.Env)
		}
		log.Debug().Str("rendezvous", cfg.Rendezvous).Msg("rank 0 hosts the rendezvous")
	}
	// ucx_perftest: both ends on rank 0's host before the ranks connect
	// when all ranks share it; otherwise rank 0 serves and rank 1 is the
	// client, across the network the ranks use, once they are connected.
	o.PerftestAcross = o.ComparePerftest && !place.SingleHost() && place.Size > 1
	if o.ComparePerftest && !o.PerftestAcross {
		// Rank 0 runs ucx_perftest before it joins the rendezvous; the
		// others wait for it there.
		cfg.BootstrapTimeout += perftestAllowance
	}
	o.Launcher = place.Launcher
	if bind == "auto" && place.Launcher == "torchrun" && place.LocalSize > 0 {
		// torchrun does not bind its workers (mpirun and srun do): bind
		// them by local rank when they fit the CPUs, as --local does.
		if cpus, err := launch.AllowedCPUs(); err == nil && place.LocalSize <= len(cpus) {
			bind = "cpu"
		}
	}
	if bind == "cpu" {
		cpus, err := launch.AllowedCPUs()
		if err != nil {
			return failed(log, exitFailure, err, "cannot bind to a CPU")
		}
		local := place.LocalRank
		if local < 0 {
			local = place.Rank
		}
		cpu := cpus[local%len(cpus)]
		if err := launch.BindProcess(cpu); err != nil {
			return failed(log, exitFailure, err, "cannot bind to a CPU")
		}
		log.Debug().Int("rank", place.Rank).Int("cpu", cpu).Msg("bound to a CPU")
	}
	return runRank(c, log, cfg, o)
}

// perftestAllowance is how much longer ranks wait at the rendezvous while
// rank 0 runs ucx_perftest.
const perftestAllowance = 15 * time.Minute

// runRank runs one rank and turns its outcome into an exit status. A rank
// keeps the default reaction to SIGINT and SIGTERM, ending at once: its
// peers then fail with an error naming it, and a launcher reports it.
func runRank(c *ucli.Context, log zerolog.Logger, cfg comm.Config, o benchmark.Options) error {
	_, err := benchmark.Run(context.Background(), benchmark.Config{Comm: cfg, Options: o, Stdout: c.App.Writer, Stderr: c.App.ErrWriter,
		StderrIsTerminal: isTerminal(c.App.ErrWriter), Log: log})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, benchmark.ErrWrong):
		return failed(log.With().Int("rank", cfg.Rank).Logger(), exitWrong, err, "benchmark failed")
	case errors.Is(err, benchmark.ErrOptions):
		return usagef(c, "%s", strings.TrimPrefix(err.Error(), benchmark.ErrOptions.Error()+": "))
	}
	return failed(log.With().Int("rank", cfg.Rank).Logger(), exitFailure, err, "benchmark failed")
}

// benchLocal starts n ranks of this program on this machine. By default
// they meet at a rendezvous this process serves on a free loopback port,
// with a fresh token, so that concurrent runs never meet each other. With
// --external-rendezvous they meet at that halod serve instead (with its
// token); with only --rendezvous, rank 0 hosts there.
func benchLocal(c *ucli.Context, log zerolog.Logger, o benchmark.Options, n int, timeout, boot time.Duration, bind string) error {
	exe, err := os.Executable()
	if err != nil {
		return failed(log, exitFailure, err, "cannot find this program to start the ranks")
	}
	jobID := c.String("job-id")
	if jobID == "" {
		jobID = "halo-bench-local"
	}
	// A fresh attempt per run: a rerun never meets a previous run's
	// addresses on a shared server.
	attempt := c.String("attempt")
	if attempt == "" {
		attempt = randomHex(8)
	}
	token := c.String("token")
	external, addr := c.Bool("external-rendezvous"), c.String("rendezvous")
	host := true // rank 0 hosts the rendezvous at addr
	switch {
	case external:
		if addr == "" {
			addr = comm.DefaultRendezvous
		}
		host = false
		log.Info().Str("rendezvous", addr).Str("job", jobID).Str("attempt", attempt).Msg("the local ranks meet at a shared halod serve")
	case addr != "":
		if token == "" {
			token = randomHex(16)
		}
		log.Debug().Str("rendezvous", addr).Msg("rank 0 hosts the rendezvous")
	default:
		token = randomHex(16)
		// The private rendezvous's routine lines only show at debug level.
		srvLevel := log.GetLevel()
		if srvLevel > zerolog.DebugLevel {
			srvLevel = max(srvLevel, zerolog.WarnLevel)
		}
		srv, err := rendezvous.NewServer(rendezvous.ServerConfig{Token: token, Logger: log.With().Str("component", "rendezvous").Logger().Level(srvLevel)})
		if err != nil {
			return failed(log, exitFailure, err, "cannot start the rendezvous")
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return failed(log, exitFailure, err, "cannot start the rendezvous")
		}
		served := make(chan error, 1)
		go func() { served <- srv.Serve(l) }()
		defer func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			srv.Shutdown(ctx)
			<-served
		}()
		addr, host = l.Addr().String(), false
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	o.Launcher = "local"
	if err := benchmark.CheckOutputs(&o); err != nil {
		return usagef(c, "%s", strings.TrimPrefix(err.Error(), benchmark.ErrOptions.Error()+": "))
	}
	oversubscribed := false
	if cpus, err := launch.AllowedCPUs(); err != nil {
		log.Warn().Err(err).Msg("ranks are not bound to CPUs")
	} else {
		if n > len(cpus) {
			oversubscribed = true
			log.Warn().Int("ranks", n).Int("cpus", len(cpus)).Msg("more ranks than CPUs: ranks wait for each other's turn on a CPU, and the times show the scheduler")
		}
		// As mpirun binds its ranks: the timings then do not depend on
		// where the scheduler happens to put two spinning ranks. Ranks
		// that must share CPUs are left to the scheduler, which does
		// better with them than a fixed share would.
		if bind == "cpu" || (bind == "auto" && n <= len(cpus)) {
			o.RankCPUs = launch.Spread(n, cpus)
		}
	}
	if o.ComparePerftest {
		// Before the ranks start, so that nothing else runs meanwhile.
		cases, _ := o.Validate()
		var sizes []int64
		for _, cs := range cases {
			sizes = append(sizes, cs.Bytes)
		}
		log.Debug().Int("sizes", len(sizes)).Msg("running ucx_perftest")
		bar := benchmark.NewProgress(c.App.ErrWriter, o.Progress, isTerminal(c.App.ErrWriter))
		bar.Start(len(sizes), "ucx_perftest")
		var cpus []int
		if len(o.RankCPUs) >= 2 {
			cpus = o.RankCPUs[:2]
		}
		pt, err := benchmark.RunPerftest(ctx, o.PerftestPath, sizes, cpus, log, bar.Set)
		bar.Finish()
		if err != nil {
			return failed(log, exitFailure, err, "ucx_perftest failed")
		}
		o.Perftest = pt
	}

	rc := rankConfig{Size: n, Rendezvous: addr, HostRendezvous: host, Job: jobID, Attempt: attempt, Timeout: timeout, BootstrapTimeout: boot,
		LogLevel: flagString(c, "log-level"), LogFormat: flagString(c, "log-format"), Options: o}
	base := make([]string, 0, len(os.Environ())+2)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, comm.SettingToken.Env+"=") && !strings.HasPrefix(kv, benchRankEnv+"=") {
			base = append(base, kv)
		}
	}
	if os.Getenv(comm.SettingSpinPolls.Env) == "" && oversubscribed {
		// Ranks sharing CPUs must yield soon: 4 ranks on 2 CPUs, 2 KiB
		// forward p50 1.6 ms with UCX's long spin, 96 us with 256 polls.
		base = append(base, comm.SettingSpinPolls.Env+"=256")
	}
	run := &launch.Local{
		N:    n,
		Path: exe,
		Args: []string{"bench-rank"},
		Env: func(rank int) []string {
			r := rc
			r.Rank = rank
			b, _ := json.Marshal(r)
			return append(append([]string(nil), base...), comm.SettingToken.Env+"="+token, benchRankEnv+"="+string(b))
		},
		Stdout: c.App.Writer,
		Stderr: c.App.ErrWriter,
		Log:    log,
	}
	err = run.Run(ctx)
	var le *launch.Error
	switch {
	case err == nil:
		return nil
	case errors.As(err, &le) && le.Interrupted:
		return &exitError{code: 128 + int(syscall.SIGINT), err: err}
	case errors.As(err, &le) && le.First.Code == exitWrong:
		// Rank 0 printed the table with the wrong counts and said so.
		return &exitError{code: exitWrong, err: err, logged: true}
	case errors.As(err, &le):
		log.Error().Int("rank", le.First.Rank).Int("status", le.First.Code).Str("signal", le.First.Signal).
			Msg("a rank failed, so the run failed: " + le.Error())
		return &exitError{code: exitFailure, err: err, logged: true}
	}
	return failed(log, exitFailure, err, "cannot run the ranks")
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// benchRankCommand is the hidden command a --local rank runs.
func benchRankCommand() *ucli.Command {
	return &ucli.Command{
		Name:   "bench-rank",
		Hidden: true,
		Usage:  "one rank of halod bench --local (started by it)",
		Action: func(c *ucli.Context) error {
			raw := os.Getenv(benchRankEnv)
			if raw == "" {
				return usagef(c, "this command is started by halod bench --local; run that instead")
			}
			var rc rankConfig
			if err := json.Unmarshal([]byte(raw), &rc); err != nil {
				return usagef(c, "%s: %v", benchRankEnv, err)
			}
			log, err := newLogger(c.App.ErrWriter, rc.LogLevel, rc.LogFormat)
			if err != nil {
				return usagef(c, "%v", err)
			}
			if cpus := rc.Options.RankCPUs; rc.Rank < len(cpus) {
				if err := launch.BindProcess(cpus[rc.Rank]); err != nil {
					return failed(log, exitFailure, err, "cannot bind to a CPU")
				}
				log.Debug().Int("rank", rc.Rank).Int("cpu", cpus[rc.Rank]).Msg("bound to a CPU")
			}
			cfg := comm.Config{Rank: rc.Rank, Size: rc.Size, Rendezvous: rc.Rendezvous, Token: os.Getenv(comm.SettingToken.Env),
				Job: rc.Job, Attempt: rc.Attempt, Timeout: rc.Timeout, BootstrapTimeout: rc.BootstrapTimeout, ExternalServer: !rc.HostRendezvous}
			return runRank(c, log, cfg, rc.Options)
		},
	}
}
