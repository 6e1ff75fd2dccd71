package benchmark

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/ucx"
	"github.com/rs/zerolog"
)

// Config is one rank's benchmark.
type Config struct {
	Comm    comm.Config
	Options Options
	// Stdout receives rank 0's table; Stderr its progress bar.
	Stdout, Stderr io.Writer
	// StderrIsTerminal decides --progress auto.
	StderrIsTerminal bool
	Log              zerolog.Logger
}

// ErrWrong is returned (by rank 0) when some data was wrong; the table and
// files are complete all the same.
var ErrWrong = errors.New("benchmark data was wrong")

// Run runs the benchmark on one rank. Every rank of the job calls it with
// the same options. Rank 0 prints the table and writes the files, and
// returns a *Report; the others return nil.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	o := cfg.Options
	cases, err := o.Validate()
	if err != nil {
		return nil, err
	}
	cfg.Comm.Transfer, _ = o.transfer() // Validate checked it
	rank := cfg.Comm.Rank
	log := cfg.Log.With().Int("rank", rank).Logger()
	started := time.Now()

	rep, err := newReporter(cfg, &o, rank, started, log)
	if err != nil {
		return nil, err
	}
	if err := rep.perftestHere(ctx, cases); err != nil {
		return nil, err
	}

	c, err := comm.New(cfg.Comm)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	log.Debug().Int("size", c.Size()).Str("rendezvous", c.Config().Rendezvous).Msg("connected")
	coll, err := newCollective(c)
	if err != nil {
		return nil, err
	}
	defer coll.close()
	if o.ComparePerftest && o.PerftestAcross && c.Size() > 1 {
		prog := rep.progress()
		sizes := perftestSizes(cases)
		prog.Start(len(sizes), "ucx_perftest")
		pt, err := runPerftestAcross(ctx, coll, o.PerftestPath, c.Config().Rendezvous, sizes, c.Config().Timeout, log, prog.Set)
		prog.Finish()
		if err != nil {
			return nil, err
		}
		o.Perftest = pt
	}

	rep.begin(c.Size(), cases)
	for i, cs := range cases {
		if err := ctx.Err(); err != nil {
			rep.abandon()
			return nil, err
		}
		rs, err := runCase(c, coll, &o, cs, log)
		if err != nil {
			rep.abandon()
			return nil, err
		}
		rep.add(i+1, cs, rs)
	}
	log.Debug().Msg("done")
	return rep.finish()
}

// CheckOutputs finds out now, not after the whole run, that the --json or
// --plot file cannot be written.
func CheckOutputs(o *Options) error {
	for _, f := range []struct{ flag, path string }{{"--json", o.JSONPath}, {"--plot", o.PlotPath}} {
		if err := checkWritable(f.path); err != nil {
			return fmt.Errorf("%w: %s %s: %v", ErrOptions, f.flag, f.path, err)
		}
	}
	return nil
}

func perftestSizes(cases []Case) []int64 {
	var s []int64
	for _, c := range cases {
		s = append(s, c.Bytes)
	}
	return s
}

func perftestAt(pt []PerftestResult, bytes int64) *PerftestResult {
	for i := range pt {
		if pt[i].Bytes == bytes {
			return &pt[i]
		}
	}
	return nil
}

// envReported are the variables that change what UCX and halo pick; the
// JSON file records them.
var envReported = []string{"UCX_TLS", "UCX_NET_DEVICES", "UCX_RNDV_THRESH", "UCX_RNDV_SCHEME",
	"UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING", "UCX_MAX_RNDV_LANES", "UCX_MAX_EAGER_LANES",
	comm.SettingCUDADriver.Env}

func newMeta(size int, o Options, started time.Time) *Meta {
	host, _ := os.Hostname()
	env := map[string]string{}
	for _, k := range envReported {
		if v, ok := os.LookupEnv(k); ok {
			env[k] = v
		}
	}
	o.Perftest = nil // reported per row
	return &Meta{HaloVersion: halo.Version, UCXVersion: ucx.Version(), Hostname: host, WorldSize: size,
		Launcher: o.Launcher, Started: started.UTC(), Env: env, Options: o}
}

// group is what the benchmark needs of a communicator: *comm.Comm, or a
// *halo.Group over an in-memory transport in tests.
type group interface {
	Rank() int
	Size() int
	NewPlan(halo.Spec) (*halo.Plan, error)
}

// streamGroup is a group with the stream-ordered path (*comm.Comm).
type streamGroup interface {
	Exchange(p *halo.Plan, d halo.Direction, bufs []unsafe.Pointer, stream uintptr) error
}

// cuStreamLegacy is CUDA's default stream as a handle (CU_STREAM_LEGACY);
// the host emulation takes any non-zero number as a stream.
const cuStreamLegacy = 0x1

// tensors are one case's buffers on one rank.
type tensors struct {
	bufs                   []*cbuf
	x, out, gradOut, gradX view
}

func (t *tensors) free() {
	for _, b := range t.bufs {
		b.free()
	}
}

func (t *tensors) alloc(n int64) (*cbuf, error) {
	b, err := allocC(n)
	if err == nil {
		t.bufs = append(t.bufs, b)
	}
	return b, err
}

// layout allocates the tensors of spec. In place, x is out's interior and
// the gradients share out's buffer (grad_x its interior), so that a 256 MiB
// halo needs three slices of memory per rank rather than eight.
func layout(spec *halo.Spec, inPlace bool) (*tensors, error) {
	elem := int64(spec.DType.Size())
	var pre, post int64 = 1, 1
	for i, n := range spec.Shape {
		switch {
		case i < spec.Dim:
			pre *= n
		case i > spec.Dim:
			post *= n
		}
	}
	n := spec.Shape[spec.Dim]
	N := spec.Left + n + spec.Right
	t := &tensors{}
	out, err := t.alloc(pre * N * post * elem)
	if err != nil {
		return nil, err
	}
	t.out = view{base: out.p, pre: pre, n: N, post: post, preStride: N * post, elem: elem}
	if inPlace {
		strides := halo.ContiguousStrides(spec.OutShape())
		spec.XStrides, spec.GradXStrides = strides, strides
		t.x = view{base: out.at(spec.Left * post * elem), pre: pre, n: n, post: post, preStride: N * post, elem: elem}
		t.gradOut, t.gradX = t.out, t.x
		return t, nil
	}
	mk := func(slices int64) (view, error) {
		b, err := t.alloc(pre * slices * post * elem)
		if err != nil {
			return view{}, err
		}
		return view{base: b.p, pre: pre, n: slices, post: post, preStride: slices * post, elem: elem}, nil
	}
	var errs [3]error
	t.x, errs[0] = mk(n)
	t.gradOut, errs[1] = mk(N)
	t.gradX, errs[2] = mk(n)
	if err := errors.Join(errs[:]...); err != nil {
		t.free()
		return nil, err
	}
	return t, nil
}

// runCase times every op of one case and returns rank 0's rows. Each op
// gets its own warm-up and timed loop, so that every row is that op in a
// steady state, as nccl-tests times one collective at a time.
func runCase(c group, coll *collective, o *Options, cs Case, log zerolog.Logger) ([]Row, error) {
	spec := cs.Spec
	t, err := layout(&spec, o.InPlace)
	if err != nil {
		return nil, err
	}
	defer t.free()
	plan, err := c.NewPlan(spec)
	if err != nil {
		return nil, err
	}
	defer plan.Close()
	log = log.With().Int64("bytes", cs.Bytes).Logger()
	chk := newChecker(spec.DType, spec.Padding, c.Rank(), plan.Lengths(), spec.Left, spec.Right)
	if o.Check && chk.gradMax == 0 {
		log.Warn().Msg("too many ranks add into one slice for exact sums in this dtype: backward is checked with zero gradients only")
	}
	// To rank 0: the busiest rank's bytes. Backward sends the gradients
	// of what forward received.
	sent, received := plan.WireBytes()
	wire := []float64{float64(sent), float64(received)}
	if err := coll.reduce(wire, maxf); err != nil {
		return nil, err
	}

	var rows []Row
	for _, op := range o.Ops {
		r, err := runOp(c, coll, o, cs, &spec, t, plan, chk, op, log.With().Str("op", op).Logger())
		if err != nil {
			return nil, err
		}
		if r != nil {
			r.SentBytes = int64(wire[0])
			if op == "backward" {
				r.SentBytes = int64(wire[1])
			}
			r.setTimes(r.times)
			rows = append(rows, *r)
			log.Debug().Str("op", op).Int("iters", r.Iters).Float64("p50_us", r.P50US).Float64("busbw_gbs", r.BusBW).Msg("measured")
		}
	}
	return rows, nil
}

// runOp warms one op up, agrees with the other ranks on how many
// iterations to time, times them back to back as training runs them, then,
// with --check, verifies the data in iterations of its own (nccl-tests'
// way: a rank that verifies between timed calls makes its peers' next
// timed call wait for it). It returns rank 0's row (without its
// statistics), or nil on the other ranks.
func runOp(c group, coll *collective, o *Options, cs Case, spec *halo.Spec, t *tensors, plan *halo.Plan, chk *checker, op string, log zerolog.Logger) (*Row, error) {
	bufs, dir := []unsafe.Pointer{t.x.base, t.out.base}, halo.DirForward
	if op != "forward" {
		bufs, dir = []unsafe.Pointer{t.gradOut.base, t.gradX.base}, halo.DirBackward
	}
	sc, _ := c.(streamGroup)
	if o.Stream && sc == nil {
		return nil, fmt.Errorf("--stream needs a communicator with a stream-ordered proxy (comm.Comm)")
	}
	call := func() error {
		var err error
		switch {
		case o.Stream:
			err = sc.Exchange(plan, dir, bufs, cuStreamLegacy)
		case op == "forward":
			err = plan.Do(halo.CallForward, true, t.x.base, t.out.base, nil)
		default:
			err = plan.Do(halo.CallBackward, true, t.gradOut.base, t.gradX.base, nil)
		}
		if err != nil {
			return fmt.Errorf("%s of a %s halo: %w", op, fmtBytes(cs.Bytes), err)
		}
		return nil
	}
	step := func() (time.Duration, error) {
		t0 := nanotime()
		err := call()
		return time.Duration(nanotime() - t0), err
	}

	// Warm-up. The median wall time of its iterations sizes the timed
	// run: the first ones also pay for connection set-up.
	warm := make([]float64, 0, o.Warmup+1)
	for it := 0; it < max(o.Warmup, 1); it++ {
		if it >= o.Warmup && o.Iters > 0 {
			break
		}
		t0 := time.Now()
		if _, err := step(); err != nil {
			return nil, err
		}
		warm = append(warm, time.Since(t0).Seconds())
	}
	iters := o.Iters
	if iters == 0 {
		sort.Float64s(warm)
		per := []float64{warm[len(warm)/2]}
		// Every rank must run the same number of iterations: agree on
		// the slowest rank's estimate.
		if err := coll.allreduce(per, maxf); err != nil {
			return nil, err
		}
		iters = int(min(max(o.Duration.Seconds()/max(per[0], 1e-9), float64(o.MinIters)), float64(o.MaxIters)))
	}

	times := make([]float64, iters)
	for it := range times {
		dt, err := step()
		if err != nil {
			return nil, err
		}
		times[it] = float64(dt.Nanoseconds()) / 1e3
	}
	if e := log.Debug(); e.Enabled() {
		own := append([]float64(nil), times...)
		sort.Float64s(own)
		e.Int("iters", iters).Float64("p50_us", percentile(own, 50)).Float64("p99_us", percentile(own, 99)).Msg("this rank's own times")
	}

	// The check: every element filled with a value of its iteration and
	// verified after the call, on every rank, untimed.
	var wrong int64
	var first *mismatch
	checked := 0
	if o.Check {
		checked = max(o.CheckIters, 1)
	}
	for k := range checked {
		it := o.Warmup + iters + k
		if op == "forward" {
			chk.fillForward(it, t.x, t.out, o.InPlace)
		} else {
			chk.fillBackward(it, t.gradOut)
		}
		if err := call(); err != nil {
			return nil, err
		}
		var n int64
		var m *mismatch
		if op == "forward" {
			n, m = chk.verifyForward(it, t.out)
		} else {
			n, m = chk.verifyBackward(it, t.gradX)
		}
		wrong += n
		if first == nil {
			first = m
		}
	}
	if first != nil {
		log.Error().Int64("wrong", wrong).Str("first", first.String()).Msg("wrong data")
	}

	// To rank 0: the slowest rank's time of each iteration, and the sum
	// of the wrong counts.
	if err := coll.reduce(times, maxf); err != nil {
		return nil, err
	}
	wr := []float64{float64(wrong)}
	if err := coll.reduce(wr, sumf); err != nil {
		return nil, err
	}
	if c.Rank() != 0 {
		return nil, nil
	}
	r := &Row{Op: op, Bytes: cs.Bytes, Count: cs.Count, DType: spec.DType.String(), Shape: spec.Shape,
		Dim: spec.Dim, Left: spec.Left, Right: spec.Right, Wrong: -1, CheckedIters: checked, times: times}
	if o.Check {
		r.Wrong = int64(math.Round(wr[0]))
	}
	return r, nil
}
