package benchmark

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// reporter is everything rank 0 does beyond measuring: ucx_perftest on this
// host, the progress bar, the table, the JSON file and the plot. The other
// ranks get a nil *reporter, whose methods do nothing, so that Run reads as
// one program for every rank.
type reporter struct {
	o       *Options
	out     io.Writer
	prog    *Progress
	log     zerolog.Logger
	started time.Time
	load    float64 // before anything of the benchmark ran
	meta    *Meta
	tab     *table
	rows    []Row
}

// newReporter returns rank 0's reporter, having made sure that its files
// can be written; nil on every other rank.
func newReporter(cfg Config, o *Options, rank int, started time.Time, log zerolog.Logger) (*reporter, error) {
	if rank != 0 {
		return nil, nil
	}
	if err := CheckOutputs(o); err != nil {
		return nil, err
	}
	return &reporter{o: o, out: cfg.Stdout, prog: NewProgress(cfg.Stderr, o.Progress, cfg.StderrIsTerminal),
		log: log, started: started, load: loadAverage()}, nil
}

// perftestHere runs ucx_perftest on this host before the communicator
// opens, so that the two never compete for the cores (the other ranks wait
// in the rendezvous meanwhile). Nothing to do when the launcher measured it
// already or when it runs between hosts (collective, after connecting).
func (r *reporter) perftestHere(ctx context.Context, cases []Case) error {
	if r == nil {
		return nil
	}
	o := r.o
	if !o.ComparePerftest || o.Perftest != nil || o.PerftestAcross {
		return nil
	}
	sizes := perftestSizes(cases)
	r.prog.Start(len(sizes), "ucx_perftest")
	pt, err := RunPerftest(ctx, o.PerftestPath, sizes, perftestCPUs(o.RankCPUs), r.log, r.prog.Set)
	r.prog.Finish()
	o.Perftest = pt
	return err
}

// progress is the bar's step callback, or nil off rank 0.
func (r *reporter) progress() *Progress {
	if r == nil {
		return nil
	}
	return r.prog
}

// begin prints the table's header.
func (r *reporter) begin(size int, cases []Case) {
	if r == nil {
		return
	}
	r.meta = newMeta(size, *r.o, r.started)
	r.meta.LoadStart, r.meta.CPUs = r.load, runtime.NumCPU()
	r.tab = &table{w: r.out, perftest: r.o.ComparePerftest}
	r.tab.header(r.meta, cases)
	r.prog.Start(len(cases), "halo")
}

// add prints one case's rows, with ucx_perftest's figures at its size.
func (r *reporter) add(done int, cs Case, rows []Row) {
	if r == nil {
		return
	}
	for k := range rows {
		rows[k].setPerftest(perftestAt(r.o.Perftest, cs.Bytes))
		r.prog.clear()
		r.tab.row(&rows[k])
	}
	r.rows = append(r.rows, rows...)
	r.prog.Set(done)
}

// abandon removes the bar after a failure.
func (r *reporter) abandon() {
	if r != nil {
		r.prog.Finish()
	}
}

// finish prints the footer, writes the files and returns the report;
// ErrWrong when some data was wrong (the report is complete all the same).
func (r *reporter) finish() (*Report, error) {
	if r == nil {
		return nil, nil
	}
	r.prog.Finish()
	sum := summarize(r.rows, r.o.Check)
	sum.ElapsedSec = time.Since(r.started).Seconds()
	sum.LoadEnd = loadAverage()
	r.tab.footer(sum, r.rows)
	rep := &Report{Meta: *r.meta, Rows: r.rows, Summary: sum}
	if p := r.o.JSONPath; p != "" {
		if err := writeJSON(p, rep); err != nil {
			return rep, fmt.Errorf("writing --json %s: %w", p, err)
		}
		r.log.Info().Str("file", p).Msg("wrote results")
	}
	if p := r.o.PlotPath; p != "" {
		if err := drawPlot(p, r.meta, r.rows); err != nil {
			return rep, fmt.Errorf("drawing --plot %s: %w", p, err)
		}
		r.log.Info().Str("file", p).Msg("wrote plot")
	}
	if sum.Wrong > 0 {
		return rep, fmt.Errorf("%w: %d wrong values", ErrWrong, sum.Wrong)
	}
	return rep, nil
}

// loadAverage is the machine's 1-minute load average (/proc/loadavg), or -1
// where there is none: a figure taken on a loaded machine says so.
func loadAverage() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return -1
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return -1
	}
	return v
}

// loadNote says whether a load average leaves the benchmark's cores to it.
// The ranks themselves spin, so only the load before they start tells
// about other tenants.
func loadNote(load float64) string {
	switch {
	case load < 0:
		return "unknown"
	case load >= 0.5*float64(runtime.NumCPU()):
		return fmt.Sprintf("%.2f on %d CPUs: LOADED, figures are noisy", load, runtime.NumCPU())
	}
	return fmt.Sprintf("%.2f on %d CPUs", load, runtime.NumCPU())
}
