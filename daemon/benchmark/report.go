package benchmark

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// Row is one line of the table, and of the JSON file.
type Row struct {
	Op    string  `json:"op"`    // forward or backward
	Bytes int64   `json:"bytes"` // halo bytes per side (the larger side)
	Count int64   `json:"count"` // the same in elements
	DType string  `json:"dtype"`
	Shape []int64 `json:"shape"` // each rank's x
	Dim   int     `json:"dim"`
	Left  int64   `json:"left"`
	Right int64   `json:"right"`
	// SentBytes is what the busiest rank sends in one call (busbw's bytes).
	SentBytes int64 `json:"sent_bytes"`
	Iters     int   `json:"iters"`
	// Times of one call, in microseconds: for each iteration the slowest
	// rank's, then the order statistics over iterations.
	P50US  float64 `json:"time_p50_us"`
	P99US  float64 `json:"time_p99_us"`
	MinUS  float64 `json:"time_min_us"`
	MeanUS float64 `json:"time_mean_us"`
	MaxUS  float64 `json:"time_max_us"`
	// Bandwidths at the median time, GB = 1e9 bytes.
	AlgBW float64 `json:"algbw_gbs"`
	BusBW float64 `json:"busbw_gbs"`
	// Wrong counts wrong elements over the checked iterations (run after
	// the timed ones, untimed) and all ranks; -1 when the data was not
	// checked.
	Wrong        int64 `json:"wrong"`
	CheckedIters int   `json:"checked_iters"`
	// Perftest is ucx_perftest at the same size, with our median latency
	// over its tag_lat (lower is better) and our busbw over its tag_bw.
	Perftest *PerftestResult `json:"perftest,omitempty"`
	LatRatio float64         `json:"lat_ratio,omitempty"`
	BWRatio  float64         `json:"bw_ratio,omitempty"`

	times []float64 // the slowest rank's time of each iteration, in µs
}

// percentile is the nearest-rank percentile of sorted samples.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	k := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[min(max(k, 0), len(sorted)-1)]
}

func (r *Row) setTimes(us []float64) {
	s := append([]float64(nil), us...)
	sort.Float64s(s)
	r.Iters = len(s)
	r.P50US, r.P99US = percentile(s, 50), percentile(s, 99)
	r.MinUS, r.MaxUS = s[0], s[len(s)-1]
	var sum float64
	for _, v := range s {
		sum += v
	}
	r.MeanUS = sum / float64(len(s))
	if r.P50US > 0 {
		r.AlgBW = float64(r.Bytes) / r.P50US / 1e3
		r.BusBW = float64(r.SentBytes) / r.P50US / 1e3
	}
}

func (r *Row) setPerftest(p *PerftestResult) {
	if p == nil || p.Error != "" {
		r.Perftest = p
		return
	}
	r.Perftest = p
	if p.LatencyUS > 0 {
		r.LatRatio = r.P50US / p.LatencyUS
	}
	if p.BWGBs > 0 {
		r.BWRatio = r.BusBW / p.BWGBs
	}
}

// Meta describes the run, for the table's header and the JSON file.
type Meta struct {
	HaloVersion string            `json:"halo_version"`
	UCXVersion  string            `json:"ucx_version"`
	Hostname    string            `json:"hostname"`
	WorldSize   int               `json:"world_size"`
	Launcher    string            `json:"launcher"`
	Started     time.Time         `json:"started"`
	Env         map[string]string `json:"env"`
	Options     Options           `json:"options"`
	// LoadStart is the 1-minute load average before the benchmark ran
	// (-1: unknown), on CPUs CPUs: a loaded machine's figures are noise.
	LoadStart float64 `json:"load_start"`
	CPUs      int     `json:"cpus"`
}

// Summary is the footer.
type Summary struct {
	Rows       int     `json:"rows"`
	Checked    bool    `json:"checked"`
	Wrong      int64   `json:"wrong"`
	AvgBusBW   float64 `json:"avg_busbw_gbs"`
	Verdict    string  `json:"verdict"` // PASS, FAIL, or UNCHECKED
	ElapsedSec float64 `json:"elapsed_s"`
	// LoadEnd is the 1-minute load average at the end, the ranks' own
	// spinning included.
	LoadEnd float64 `json:"load_end"`
}

func fmtBytes(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%dGiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

func shortOp(op string) string {
	if op == "backward" {
		return "bwd"
	}
	return "fwd"
}

// table prints rows nccl-tests style: '#' comment lines, fixed widths.
type table struct {
	w        io.Writer
	perftest bool
}

func (t *table) header(m *Meta, cases []Case) {
	o := &m.Options
	fmt.Fprintf(t.w, "# halod bench: halo %s, UCX %s, %d ranks (%s) on %s\n", m.HaloVersion, m.UCXVersion, m.WorldSize, m.Launcher, m.Hostname)
	tls := m.Env["UCX_TLS"]
	if tls == "" {
		tls = "(UCX's default)"
	}
	fmt.Fprintf(t.w, "# UCX_TLS=%s\n", tls)
	place := "x is a separate tensor"
	if o.InPlace {
		place = "in place: x is out's interior"
	}
	if o.Padding != "" && o.Padding != "zeros" {
		place += "; " + o.Padding + " padding"
	}
	if o.Stream {
		drv := m.Env["HALO_CUDA_DRIVER"]
		if drv == "" {
			drv = "cuda"
		}
		place += "; stream-ordered: each exchange queued on a stream, run by the proxy, waited for on the host (" + drv + " driver)"
	}
	if o.Shape == nil {
		first, last := cases[0].Bytes, cases[len(cases)-1].Bytes
		fmt.Fprintf(t.w, "# workload: halos of %s to %s per side (x%d), one slice of a [1, count] %s tensor on the %s; %s; %s\n",
			fmtBytes(first), fmtBytes(last), o.StepFactor, o.DType, sides(o.Left, o.Right), place, strings.Join(o.Ops, " then "))
	} else {
		fmt.Fprintf(t.w, "# workload: x %s %s per rank, dim %d, left %d right %d slices; %s; %s\n",
			FormatShape(o.Shape), o.DType, o.Dim, o.Left, o.Right, place, strings.Join(o.Ops, " then "))
	}
	if o.Iters > 0 {
		fmt.Fprintf(t.w, "# timing: %d warm-up iterations, then %d timed iterations per size\n", o.Warmup, o.Iters)
	} else {
		fmt.Fprintf(t.w, "# timing: %d warm-up iterations, then as many as fit in %s per size (%d to %d)\n", o.Warmup, o.Duration, o.MinIters, o.MaxIters)
	}
	fmt.Fprintf(t.w, "# time: one exchange both ways (every rank sends its halos and receives its neighbours'), timed back to back;\n")
	fmt.Fprintf(t.w, "#   per iteration the slowest rank's call, p50/p99 over iterations. algbw = size/p50, busbw = bytes the busiest rank sends/p50; GB = 1e9 B\n")
	if o.Check {
		fmt.Fprintf(t.w, "# check: %d iterations of their own after the timed ones, every element verified on every rank (untimed)\n", max(o.CheckIters, 1))
	} else {
		fmt.Fprintf(t.w, "# check: off (#wrong shows -1; run with --check to verify the data)\n")
	}
	fmt.Fprintf(t.w, "# load average before the run: %s\n", loadNote(m.LoadStart))
	if len(o.RankCPUs) > 0 {
		fmt.Fprintf(t.w, "# binding: rank r on CPU %s (rank order)\n", intList(o.RankCPUs))
	}
	if t.perftest {
		where := "on this host"
		if o.PerftestAcross {
			where = "between hosts (server on rank 0, client on rank 1)"
		}
		fmt.Fprintf(t.w, "# ucx_perftest, run in this same run %s: tag_lat p50 (one message one way: half a ping-pong round trip)\n", where)
		fmt.Fprintf(t.w, "#   and tag_bw (a stream of pipelined messages one way); an exchange both ways can at best match tag_lat and tag_bw\n")
		fmt.Fprintf(t.w, "#   lat ratio = our p50 / tag_lat (lower is better); bw ratio = our busbw / tag_bw (higher is better)\n")
	}
	fmt.Fprintln(t.w, "#")
	line1 := "#                                                   time (us)           bandwidth (GB/s)"
	line2 := "#       size        count      type   op    iters       p50       p99      algbw     busbw  #wrong"
	line3 := "#        (B)   (elements)                                                                          "
	if t.perftest {
		line1 += "           ucx_perftest, same sizes"
		line2 += "   lat(us)  ratio   bw(GB/s)  ratio"
	}
	fmt.Fprintln(t.w, line1)
	fmt.Fprintln(t.w, line2)
	fmt.Fprintln(t.w, strings.TrimRight(line3, " "))
}

func intList(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ",")
}

func sides(left, right int64) string {
	switch {
	case left > 0 && right > 0:
		return "left and right"
	case left > 0:
		return "left only"
	}
	return "right only"
}

func (t *table) row(r *Row) {
	line := fmt.Sprintf("%12d %12d %9s %4s %8d %9.2f %9.2f %10.3f %9.3f %7d",
		r.Bytes, r.Count, r.DType, shortOp(r.Op), r.Iters, r.P50US, r.P99US, r.AlgBW, r.BusBW, r.Wrong)
	if t.perftest {
		switch p := r.Perftest; {
		case p == nil:
			line += fmt.Sprintf(" %9s %6s %10s %6s", "-", "-", "-", "-")
		case p.Error != "":
			line += fmt.Sprintf(" %9s %6s %10s %6s", "failed", "-", "failed", "-")
		default:
			line += fmt.Sprintf(" %9.2f %5.2fx %10.3f %5.2fx", p.LatencyUS, r.LatRatio, p.BWGBs, r.BWRatio)
		}
	}
	fmt.Fprintln(t.w, line)
}

func summarize(rows []Row, checked bool) Summary {
	s := Summary{Rows: len(rows), Checked: checked}
	var sum float64
	for _, r := range rows {
		sum += r.BusBW
		if r.Wrong > 0 {
			s.Wrong += r.Wrong
		}
	}
	if len(rows) > 0 {
		s.AvgBusBW = sum / float64(len(rows))
	}
	switch {
	case s.Wrong > 0:
		s.Verdict = "FAIL"
	case checked:
		s.Verdict = "PASS"
	default:
		s.Verdict = "UNCHECKED"
	}
	return s
}

func (t *table) footer(s Summary, rows []Row) {
	fmt.Fprintln(t.w, "#")
	switch s.Verdict {
	case "FAIL":
		fmt.Fprintf(t.w, "# Wrong values       : %d  FAIL\n", s.Wrong)
	case "PASS":
		fmt.Fprintf(t.w, "# Wrong values       : 0  OK (the check iterations verified on every rank)\n")
	default:
		fmt.Fprintf(t.w, "# Wrong values       : not checked (run with --check)\n")
	}
	fmt.Fprintf(t.w, "# Avg bus bandwidth  : %.3f GB/s (mean of %d rows)\n", s.AvgBusBW, s.Rows)
	if t.perftest {
		var lat, bw []float64
		for _, r := range rows {
			if r.LatRatio > 0 {
				lat = append(lat, r.LatRatio)
			}
			if r.BWRatio > 0 {
				bw = append(bw, r.BWRatio)
			}
		}
		if len(lat) > 0 {
			fmt.Fprintf(t.w, "# vs ucx_perftest    : latency ratio %.2fx (geometric mean), bandwidth ratio %.2fx (geometric mean)\n", geomean(lat), geomean(bw))
		}
	}
	if s.LoadEnd >= 0 {
		fmt.Fprintf(t.w, "# Load average       : %.2f at the end (the ranks' own spinning included)\n", s.LoadEnd)
	}
	fmt.Fprintf(t.w, "# Result             : %s\n", s.Verdict)
}

func geomean(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	var s float64
	for _, x := range v {
		s += math.Log(x)
	}
	return math.Exp(s / float64(len(v)))
}

// Report is what --json writes.
type Report struct {
	Meta    Meta    `json:"meta"`
	Rows    []Row   `json:"rows"`
	Summary Summary `json:"summary"`
}

func writeJSON(path string, rep *Report) error {
	b, err := json.MarshalIndent(rep, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(path, append(b, '\n'))
}

// checkWritable makes sure path's directory exists and takes a new file.
func checkWritable(path string) error {
	if path == "" {
		return nil
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	f.Close()
	return os.Remove(f.Name())
}

// writeFileAtomic writes through a temporary file in the same directory, so
// that a reader never sees half a file.
func writeFileAtomic(path string, data []byte) error {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(f.Name())
		return err
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return err
	}
	if err := os.Chmod(f.Name(), 0o644); err != nil {
		os.Remove(f.Name())
		return err
	}
	return os.Rename(f.Name(), path)
}
