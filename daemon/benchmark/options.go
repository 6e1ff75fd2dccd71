// Package benchmark is halod bench: the halo exchange timed across ranks,
// nccl-tests style. Every rank runs Run; rank 0 prints the table, writes
// the JSON and the plot. Results reach rank 0 through halo exchanges of
// their own (see collective.go), so the benchmark needs nothing but the
// communicator it measures.
package benchmark

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/halo-cp/halo/comm"
	"github.com/halo-cp/halo/halo"
)

// Options say what to measure and how. They travel as JSON from halod
// bench --local to the ranks it starts, so every field is exported.
type Options struct {
	// Shape is each rank's shard (x); nil means a sweep of halo sizes.
	Shape []int64 `json:"shape,omitempty"`
	Dim   int     `json:"dim"`
	// Left and Right are halo slices; in a sweep they only say which sides
	// have a halo (0 or 1), the slice being the swept size.
	Left  int64  `json:"left"`
	Right int64  `json:"right"`
	DType string `json:"dtype"`
	// MinBytes..MaxBytes, multiplied by StepFactor: the sweep, in bytes
	// per side.
	MinBytes   int64 `json:"min_bytes"`
	MaxBytes   int64 `json:"max_bytes"`
	StepFactor int64 `json:"step_factor"`
	// Ops are "forward" and/or "backward"; each is timed in a loop of its
	// own, in this order, at every size.
	Ops []string `json:"ops"`
	// InPlace makes x the interior of out and grad_x the interior of
	// grad_out, the layout that saves the interior copy.
	InPlace  bool   `json:"in_place"`
	Transfer string `json:"transfer"` // auto, pack or iov
	// Stream times the stream-ordered path: every exchange is ordered on a
	// stream (CU_STREAM_LEGACY) by the communicator's proxy, the host
	// waiting for it (comm.Comm.Exchange). On a CPU, HALO_CUDA_DRIVER=host-fake.
	Stream bool `json:"stream,omitempty"`
	// Padding fills the halo slots beyond the sequence's ends: zeros,
	// replicate, reflect or circular.
	Padding string `json:"padding"`

	Warmup int `json:"warmup"`
	// Iters is the number of timed iterations per size; 0 means as many
	// as fit in Duration, between MinIters and MaxIters.
	Iters    int           `json:"iters"`
	Duration time.Duration `json:"duration_ns"`
	MinIters int           `json:"min_iters"`
	MaxIters int           `json:"max_iters"`
	Check    bool          `json:"check"`
	// CheckIters is how many iterations --check verifies, after the
	// timed ones and apart from them.
	CheckIters int `json:"check_iters"`

	// Rank 0's outputs.
	JSONPath        string `json:"json_path,omitempty"`
	PlotPath        string `json:"plot_path,omitempty"`
	ComparePerftest bool   `json:"compare_perftest"`
	PerftestPath    string `json:"perftest_path,omitempty"`
	// Progress: "auto" (a bar when stderr is a terminal), "on" or "off".
	Progress string `json:"progress"`
	// Perftest holds ucx_perftest's figures when the launcher measured
	// them before starting the ranks; otherwise rank 0 measures them.
	Perftest []PerftestResult `json:"perftest,omitempty"`

	// PerftestAcross runs ucx_perftest between ranks 0 and 1 (server on
	// rank 0, client on rank 1) once they are connected, for ranks on
	// different hosts; otherwise rank 0 (or the launcher) runs both ends
	// before the ranks connect.
	PerftestAcross bool `json:"perftest_across,omitempty"`

	// RankCPUs is the CPU each rank was bound to, when the launcher bound
	// them (halod bench --local); ucx_perftest's server and client then run
	// on the CPUs of ranks 0 and 1.
	RankCPUs []int `json:"rank_cpus,omitempty"`

	// For the record: how the run was started.
	Launcher string   `json:"launcher"`
	Command  []string `json:"command,omitempty"`
}

// Defaults returns the options of a plain "halod bench".
func Defaults() Options {
	return Options{
		Left: 1, Right: 1, DType: "float32",
		MinBytes: 8, MaxBytes: 256 << 20, StepFactor: 2,
		Ops: []string{"forward", "backward"}, InPlace: true, Transfer: "auto", Padding: "zeros",
		Warmup: 10, CheckIters: 20, Duration: 300 * time.Millisecond, MinIters: 5, MaxIters: 100000,
		Progress: "auto",
	}
}

// Case is one row group of the table: one layout, timed for every op.
type Case struct {
	Spec halo.Spec
	// Bytes is the halo size of the table's "size" column: bytes of the
	// larger side. Count is the same in elements.
	Bytes int64
	Count int64
}

// OpsFromFlag turns --op (forward, backward or both) into Options.Ops.
func OpsFromFlag(s string) ([]string, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "forward", "fwd":
		return []string{"forward"}, nil
	case "backward", "bwd":
		return []string{"backward"}, nil
	case "both", "":
		return []string{"forward", "backward"}, nil
	}
	return nil, fmt.Errorf("--op %q: want forward, backward or both", s)
}

// FormatShape writes a shape the way --shape takes it.
func FormatShape(shape []int64) string {
	var b strings.Builder
	for i, n := range shape {
		if i > 0 {
			b.WriteByte('x')
		}
		b.WriteString(strconv.FormatInt(n, 10))
	}
	return b.String()
}

// ParseShape reads "1x128x16x64x64" (or with commas).
func ParseShape(s string) ([]int64, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	parts := strings.FieldsFunc(s, func(r rune) bool { return r == 'x' || r == 'X' || r == ',' || r == '*' })
	if len(parts) == 0 || len(parts) > halo.MaxDims {
		return nil, fmt.Errorf("--shape %q: want 1 to %d sizes like 1x128x16x64x64", s, halo.MaxDims)
	}
	shape := make([]int64, len(parts))
	for i, p := range parts {
		n, err := strconv.ParseInt(strings.TrimSpace(p), 10, 64)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("--shape %q: %q is not a positive size", s, p)
		}
		shape[i] = n
	}
	return shape, nil
}

// transfer reads o.Transfer as the library reads its setting; empty is
// unset, and so auto.
func (o *Options) transfer() (halo.Transfer, error) {
	if o.Transfer == "" {
		return halo.TransferAuto, nil
	}
	t, err := comm.ParseTransfer(o.Transfer)
	if err != nil {
		return 0, fmt.Errorf("--transfer %q: %v", o.Transfer, err)
	}
	return t, nil
}

// parseDType accepts the names people type: float32/f32/fp32, bf16, ...
func parseDType(s string) (halo.DType, error) {
	switch s {
	case "float32", "f32", "fp32", "float":
		return halo.Float32, nil
	case "float64", "f64", "fp64", "double":
		return halo.Float64, nil
	case "float16", "f16", "fp16", "half":
		return halo.Float16, nil
	case "bfloat16", "bf16":
		return halo.BFloat16, nil
	}
	return 0, fmt.Errorf("unknown dtype %q (want float32, float64, float16 or bfloat16)", s)
}

// ParsePadding accepts torch's padding_mode names.
func ParsePadding(s string) (halo.Padding, error) {
	for _, m := range []halo.Padding{halo.PadZeros, halo.PadReplicate, halo.PadReflect, halo.PadCircular} {
		if s == m.String() {
			return m, nil
		}
	}
	return 0, fmt.Errorf("unknown padding %q (want zeros, replicate, reflect or circular)", s)
}

// ErrOptions marks a problem with the options (a usage error).
var ErrOptions = errors.New("invalid benchmark options")

func optErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrOptions, fmt.Sprintf(format, args...))
}

// Validate checks the options and returns the cases they describe.
func (o *Options) Validate() ([]Case, error) {
	dt, err := parseDType(o.DType)
	if err != nil {
		return nil, optErr("--dtype: %v", err)
	}
	o.DType = dt.String()
	if o.Padding == "" {
		o.Padding = "zeros"
	}
	pad, err := ParsePadding(o.Padding)
	if err != nil {
		return nil, optErr("--padding: %v", err)
	}
	if len(o.Ops) == 0 {
		return nil, optErr("no operation to run")
	}
	for _, op := range o.Ops {
		if op != "forward" && op != "backward" {
			return nil, optErr("unknown operation %q", op)
		}
	}
	if _, err := o.transfer(); err != nil {
		return nil, optErr("%v", err)
	}
	switch {
	case o.Warmup < 0:
		return nil, optErr("--warmup %d is negative", o.Warmup)
	case o.Iters < 0:
		return nil, optErr("--iters %d is negative", o.Iters)
	case o.Check && o.CheckIters < 1:
		return nil, optErr("--check-iters %d: --check needs at least one iteration", o.CheckIters)
	case o.Iters == 0 && o.Duration <= 0:
		return nil, optErr("--duration must be positive when --iters is 0")
	case o.MinIters < 1:
		return nil, optErr("--min-iters %d: at least one iteration is needed", o.MinIters)
	case o.MaxIters < o.MinIters:
		return nil, optErr("--max-iters %d is below --min-iters %d", o.MaxIters, o.MinIters)
	case o.Iters > 10_000_000 || o.MaxIters > 10_000_000:
		return nil, optErr("more than 10000000 iterations per size")
	}
	switch strings.ToLower(o.Progress) {
	case "auto", "on", "off":
	default:
		return nil, optErr("--progress %q: want auto, on or off", o.Progress)
	}
	if o.PlotPath != "" && !strings.HasSuffix(strings.ToLower(o.PlotPath), ".png") &&
		!strings.HasSuffix(strings.ToLower(o.PlotPath), ".svg") && !strings.HasSuffix(strings.ToLower(o.PlotPath), ".pdf") {
		return nil, optErr("--plot %q: the file name must end in .png, .svg or .pdf", o.PlotPath)
	}
	elem := int64(dt.Size())
	cases, err := o.sweepCases(dt, elem)
	if o.Shape != nil {
		cases, err = o.shapeCase(dt, elem)
	}
	for i := range cases {
		cases[i].Spec.Padding = pad
	}
	return cases, err
}

func (o *Options) shapeCase(dt halo.DType, elem int64) ([]Case, error) {
	nd := len(o.Shape)
	if o.Dim < 0 || o.Dim >= nd {
		return nil, optErr("--dim %d is out of range for the %d-d --shape %v", o.Dim, nd, o.Shape)
	}
	if o.Left < 0 || o.Right < 0 {
		return nil, optErr("--left %d / --right %d: halo sizes cannot be negative", o.Left, o.Right)
	}
	if o.Left == 0 && o.Right == 0 {
		return nil, optErr("--left and --right are both 0: there is no halo to exchange")
	}
	slice := elem
	total := elem
	for i, n := range o.Shape {
		if n < 1 {
			return nil, optErr("--shape: size %d of dim %d is not positive", n, i)
		}
		if total > math.MaxInt64/(n+o.Left+o.Right) {
			return nil, optErr("--shape %v is too large", o.Shape)
		}
		total *= n
		if i != o.Dim {
			slice *= n
		}
	}
	if (o.Shape[o.Dim]+o.Left+o.Right)*slice > 64<<30 {
		return nil, optErr("--shape %v with halos %d+%d needs more than 64 GiB per tensor", o.Shape, o.Left, o.Right)
	}
	spec := halo.Spec{DType: dt, Shape: append([]int64(nil), o.Shape...), Dim: o.Dim, Left: o.Left, Right: o.Right}
	side := max(o.Left, o.Right) * slice
	return []Case{{Spec: spec, Bytes: side, Count: side / elem}}, nil
}

func (o *Options) sweepCases(dt halo.DType, elem int64) ([]Case, error) {
	if (o.Left != 0 && o.Left != 1) || (o.Right != 0 && o.Right != 1) {
		return nil, optErr("in a size sweep --left and --right say which sides have a halo (0 or 1); use --shape for halos of several slices")
	}
	if o.Left == 0 && o.Right == 0 {
		return nil, optErr("--left and --right are both 0: there is no halo to exchange")
	}
	if o.Dim != 0 {
		return nil, optErr("--dim applies to --shape only (a sweep exchanges slices of a [1, count] tensor along dim 0)")
	}
	switch {
	case o.MinBytes < 1:
		return nil, optErr("--min-bytes must be at least 1")
	case o.MaxBytes < o.MinBytes:
		return nil, optErr("--max-bytes %d is below --min-bytes %d", o.MaxBytes, o.MinBytes)
	case o.MaxBytes > 16<<30:
		return nil, optErr("--max-bytes %d is above 16 GiB per side", o.MaxBytes)
	case o.StepFactor < 2:
		return nil, optErr("--step-factor %d: must be at least 2", o.StepFactor)
	}
	var cases []Case
	last := int64(-1)
	for s := o.MinBytes; s <= o.MaxBytes; s *= o.StepFactor {
		b := max(elem, s/elem*elem)
		if b != last {
			last = b
			spec := halo.Spec{DType: dt, Shape: []int64{1, b / elem}, Dim: 0, Left: o.Left, Right: o.Right}
			cases = append(cases, Case{Spec: spec, Bytes: b, Count: b / elem})
		}
		if s > math.MaxInt64/o.StepFactor {
			break
		}
	}
	return cases, nil
}
