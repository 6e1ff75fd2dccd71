package benchmark

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
	"github.com/rs/zerolog"
)

func TestSweepCases(t *testing.T) {
	o := Defaults()
	cases, err := o.Validate()
	if err != nil {
		t.Fatal(err)
	}
	if len(cases) != 26 || cases[0].Bytes != 8 || cases[25].Bytes != 256<<20 || cases[0].Count != 2 {
		t.Fatalf("default sweep: %d cases from %d to %d bytes", len(cases), cases[0].Bytes, cases[len(cases)-1].Bytes)
	}
	o.DType, o.MinBytes, o.MaxBytes, o.StepFactor = "f64", 3, 100, 3
	cases, err = o.Validate()
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	for _, c := range cases {
		got = append(got, c.Bytes)
		if c.Spec.Shape[1]*8 != c.Bytes {
			t.Errorf("case of %d bytes has shape %v", c.Bytes, c.Spec.Shape)
		}
	}
	// 3 -> one element (8), 9 -> 8 again (dropped), 27 -> 24, 81 -> 80.
	if fmt.Sprint(got) != "[8 24 80]" {
		t.Errorf("float64 sweep 3..100 x3 = %v, want [8 24 80]", got)
	}
}

func TestShapeCase(t *testing.T) {
	o := Defaults()
	o.Shape, o.Dim, o.Left, o.Right, o.DType = []int64{1, 128, 16, 64, 64}, 2, 2, 2, "bf16"
	cases, err := o.Validate()
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(2 * 128 * 64 * 64 * 2); len(cases) != 1 || cases[0].Bytes != want || cases[0].Count != want/2 {
		t.Fatalf("got %+v, want one case of %d bytes", cases, want)
	}
}

func TestOptionErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Options)
		want string
	}{
		{"dtype", func(o *Options) { o.DType = "int8" }, "dtype"},
		{"sweep halo", func(o *Options) { o.Left = 2 }, "0 or 1"},
		{"no halo", func(o *Options) { o.Left, o.Right = 0, 0 }, "no halo"},
		{"dim", func(o *Options) { o.Shape, o.Dim = []int64{4, 4}, 2 }, "--dim 2 is out of range"},
		{"min max", func(o *Options) { o.MinBytes, o.MaxBytes = 10, 5 }, "below --min-bytes"},
		{"step", func(o *Options) { o.StepFactor = 1 }, "--step-factor"},
		{"padding", func(o *Options) { o.Padding = "mirror" }, `--padding: unknown padding "mirror"`},
		{"iters", func(o *Options) { o.MinIters, o.MaxIters = 10, 5 }, "--max-iters"},
		{"plot", func(o *Options) { o.PlotPath = "x.jpg" }, ".png"},
		{"progress", func(o *Options) { o.Progress = "maybe" }, "--progress"},
		{"transfer", func(o *Options) { o.Transfer = "zip" }, "--transfer"},
	} {
		o := Defaults()
		tc.edit(&o)
		_, err := o.Validate()
		if err == nil || !errors.Is(err, ErrOptions) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an options error mentioning %q", tc.name, err, tc.want)
		}
	}
}

func TestParseShape(t *testing.T) {
	if s, err := ParseShape("1x128x16x64x64"); err != nil || fmt.Sprint(s) != "[1 128 16 64 64]" {
		t.Errorf("got %v, %v", s, err)
	}
	for _, bad := range []string{"1x0", "ax2", "1x2x3x4x5x6x7x8x9", "x"} {
		if _, err := ParseShape(bad); err == nil {
			t.Errorf("ParseShape(%q) accepted", bad)
		}
	}
}

// runGroup runs fn on every rank of an in-memory group, concurrently.
func runGroup(t *testing.T, size int, fn func(g *halo.Group) error) {
	t.Helper()
	for r, err := range halotest.Groups(size, halo.GroupOptions{Timeout: 20 * time.Second}, fn) {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
}

// TestCheckPasses runs the timed loop with --check over the in-memory
// transport for several layouts, dtypes and world sizes: a correct
// exchange must count no wrong value.
func TestCheckPasses(t *testing.T) {
	type layoutCase struct {
		name  string
		shape []int64
		dim   int
		l, r  int64
	}
	layouts := []layoutCase{
		{"sweep", nil, 0, 1, 1},
		{"left only", nil, 0, 1, 0},
		{"5d", []int64{2, 3, 4, 2}, 2, 2, 1},
		{"multi-hop", []int64{2, 1, 3}, 1, 2, 3},
	}
	for _, W := range []int{1, 2, 3} {
		for k, lc := range layouts {
			for j, dt := range []string{"float32", "bfloat16", "float16", "float64"} {
				for _, inPlace := range []bool{true, false} {
					// Every padding mode in turn, where the sequence is
					// long enough for it (torch's rules), else replicate.
					pad := []string{"zeros", "replicate", "reflect", "circular"}[(W+k+j)%4]
					T, h := int64(W), max(lc.l, lc.r)
					if lc.shape != nil {
						T *= lc.shape[lc.dim]
					}
					if (pad == "reflect" && h >= T) || (pad == "circular" && h > T) {
						pad = "replicate"
					}
					name := fmt.Sprintf("W%d/%s/%s/%s/inplace=%v", W, lc.name, dt, pad, inPlace)
					t.Run(name, func(t *testing.T) {
						o := Defaults()
						o.Shape, o.Dim, o.Left, o.Right, o.DType, o.InPlace = lc.shape, lc.dim, lc.l, lc.r, dt, inPlace
						o.Padding = pad
						o.MinBytes, o.MaxBytes, o.StepFactor = 8, 64, 8
						o.Warmup, o.Iters, o.Check, o.CheckIters = 1, 3, true, 4
						cases, err := o.Validate()
						if err != nil {
							t.Fatal(err)
						}
						var mu sync.Mutex
						var rows []Row
						runGroup(t, W, func(g *halo.Group) error {
							coll, err := newCollective(g)
							if err != nil {
								return err
							}
							defer coll.close()
							for _, cs := range cases {
								rs, err := runCase(g, coll, &o, cs, zerolog.Nop())
								if err != nil {
									return err
								}
								mu.Lock()
								rows = append(rows, rs...)
								mu.Unlock()
							}
							return nil
						})
						if len(rows) != 2*len(cases) {
							t.Fatalf("%d rows for %d cases and 2 ops", len(rows), len(cases))
						}
						for _, r := range rows {
							if r.Wrong != 0 || r.Iters != 3 || r.CheckedIters != 4 {
								t.Errorf("%s %d B: %d wrong in %d checked iterations (%d timed)", r.Op, r.Bytes, r.Wrong, r.CheckedIters, r.Iters)
							}
							if W > 1 && r.SentBytes <= 0 {
								t.Errorf("%s %d B: busiest rank sends %d bytes", r.Op, r.Bytes, r.SentBytes)
							}
						}
					})
				}
			}
		}
	}
}

// TestCheckCatchesCorruption spoils one element after each call and
// expects exactly one wrong value, described with the rank it came from.
func TestCheckCatchesCorruption(t *testing.T) {
	for _, dt := range []halo.DType{halo.Float32, halo.BFloat16} {
		spec := halo.Spec{DType: dt, Shape: []int64{2, 3, 4}, Dim: 1, Left: 1, Right: 1}
		var mu sync.Mutex
		var got []string
		runGroup(t, 2, func(g *halo.Group) error {
			s := spec
			tn, err := layout(&s, true)
			if err != nil {
				return err
			}
			defer tn.free()
			plan, err := g.NewPlan(s)
			if err != nil {
				return err
			}
			defer plan.Close()
			chk := newChecker(s.DType, s.Padding, g.Rank(), plan.Lengths(), s.Left, s.Right)
			chk.fillForward(7, tn.x, tn.out, true)
			if err := plan.Do(halo.CallForward, true, tn.x.base, tn.out.base, nil); err != nil {
				return err
			}
			if n, m := chk.verifyForward(7, tn.out); n != 0 {
				return fmt.Errorf("%d wrong before corruption: %v", n, m)
			}
			// Rank 0's right halo (from rank 1), rank 1's left halo (from rank 0).
			j := int64(4)
			if g.Rank() == 1 {
				j = 0
			}
			p := (*uint8)(tn.out.row(1, j))
			*p ^= 1
			n, m := chk.verifyForward(7, tn.out)
			if n != 1 || m == nil {
				return fmt.Errorf("forward: %d wrong after one flipped bit", n)
			}
			chk.fillBackward(8, tn.gradOut)
			if err := plan.Do(halo.CallBackward, true, tn.gradOut.base, tn.gradX.base, nil); err != nil {
				return err
			}
			if n, m := chk.verifyBackward(8, tn.gradX); n != 0 {
				return fmt.Errorf("%d wrong gradients before corruption: %v", n, m)
			}
			q := (*uint8)(unsafe.Add(tn.gradX.row(0, 0), 1))
			*q ^= 0x40
			nb, mb := chk.verifyBackward(8, tn.gradX)
			if nb != 1 || mb == nil {
				return fmt.Errorf("backward: %d wrong after one flipped bit", nb)
			}
			mu.Lock()
			got = append(got, m.String(), mb.String())
			mu.Unlock()
			return nil
		})
		all := strings.Join(got, "\n")
		if !strings.Contains(all, "from rank 1") || !strings.Contains(all, "from rank 0") || !strings.Contains(all, "grad_x") {
			t.Errorf("%s: mismatch descriptions:\n%s", dt, all)
		}
	}
}

func TestPercentile(t *testing.T) {
	s := []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	if p := percentile(s, 50); p != 5 {
		t.Errorf("p50 = %v", p)
	}
	if p := percentile(s, 99); p != 10 {
		t.Errorf("p99 = %v", p)
	}
	r := Row{Bytes: 2000, SentBytes: 4000}
	r.setTimes([]float64{3, 1, 2})
	if r.P50US != 2 || r.MinUS != 1 || r.MaxUS != 3 || r.AlgBW != 1 || r.BusBW != 2 {
		t.Errorf("row stats: %+v", r)
	}
}

const perftestOutput = `+--------------+--------------+------------------------------+---------------------+-----------------------+
|              |              |        latency (usec)        |   bandwidth (MB/s)  |  message rate (msg/s) |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
|     Test     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
                       20000      0.546     5.478   231.256        1.39       0.03      182562        4324
`

func TestParsePerftest(t *testing.T) {
	l, err := parsePerftest(perftestOutput)
	if err != nil {
		t.Fatal(err)
	}
	if l.iters != 20000 || l.latP50 != 0.546 || l.bwOverallMiBs != 0.03 {
		t.Errorf("parsed %+v", l)
	}
	l, err = parsePerftest("Final:                 10000      1.129     1.262     1.262     1548.20    1548.20      792679      792679\n")
	if err != nil || l.latP50 != 1.129 || l.bwOverallMiBs != 1548.20 {
		t.Errorf("Final line: %+v, %v", l, err)
	}
	if _, err := parsePerftest("connect() failed: Connection refused\n"); err == nil {
		t.Error("no result line accepted")
	}
}

func sampleRows() []Row {
	var rows []Row
	for i, b := range []int64{8, 2048, 2 << 20} {
		for _, op := range []string{"forward", "backward"} {
			r := Row{Op: op, Bytes: b, Count: b / 4, DType: "float32", SentBytes: 2 * b, Wrong: 0}
			r.setTimes([]float64{float64(1 + i*100), float64(2 + i*100), float64(5 + i*200)})
			r.setPerftest(&PerftestResult{Bytes: b, LatencyUS: 0.5 + float64(i*50), BWGBs: 0.01 + float64(i*5)})
			rows = append(rows, r)
		}
	}
	return rows
}

func TestTable(t *testing.T) {
	var buf bytes.Buffer
	tab := &table{w: &buf, perftest: true}
	o := Defaults()
	o.Check = true
	cases, _ := o.Validate()
	m := &Meta{HaloVersion: "0.1.0", UCXVersion: "1.13.1", Hostname: "h", WorldSize: 2, Launcher: "local", Options: o}
	tab.header(m, cases)
	rows := sampleRows()
	for i := range rows {
		tab.row(&rows[i])
	}
	s := summarize(rows, true)
	tab.footer(s, rows)
	out := buf.String()
	for _, want := range []string{"#wrong", "busbw", "GB = 1e9", "ucx_perftest", "Result             : PASS", "Avg bus bandwidth",
		"timed back to back", "20 iterations of their own after the timed ones", "load average before the run", "half a ping-pong round trip"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	// Every data line has the same width, and the header's last column
	// ends where the numbers end.
	var widths []int
	for _, line := range strings.Split(out, "\n") {
		if line != "" && !strings.HasPrefix(line, "#") {
			widths = append(widths, len(line))
		}
	}
	if len(widths) != len(rows) {
		t.Fatalf("%d data lines for %d rows", len(widths), len(rows))
	}
	for _, w := range widths {
		if w != widths[0] {
			t.Errorf("data lines of different widths: %v", widths)
			break
		}
	}
	rows[1].Wrong = 3
	if s := summarize(rows, true); s.Verdict != "FAIL" || s.Wrong != 3 {
		t.Errorf("summary with 3 wrong: %+v", s)
	}
}

func TestPlotAndJSON(t *testing.T) {
	dir := t.TempDir()
	rows := sampleRows()
	m := &Meta{WorldSize: 2, Options: Defaults()}
	for _, name := range []string{"p.png", "p.svg", "p.pdf"} {
		path := filepath.Join(dir, name)
		if err := drawPlot(path, m, rows); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil || len(b) < 1000 {
			t.Fatalf("%s: %d bytes, %v", name, len(b), err)
		}
		if name == "p.png" && !bytes.HasPrefix(b, []byte("\x89PNG")) {
			t.Errorf("%s is not a PNG", name)
		}
	}
	path := filepath.Join(dir, "sub", "r.json")
	if err := writeJSON(path, &Report{Meta: *m, Rows: rows, Summary: summarize(rows, true)}); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(path); err != nil || !bytes.Contains(b, []byte(`"busbw_gbs"`)) {
		t.Errorf("json: %v\n%s", err, b)
	}
}

// TestReporterOffRankZero: every rank but 0 runs the same program with a
// nil reporter, which prints and writes nothing.
func TestReporterOffRankZero(t *testing.T) {
	o := Defaults()
	o.JSONPath = "/nonexistent-dir-for-sure/x.json" // not checked off rank 0
	r, err := newReporter(Config{}, &o, 1, time.Now(), zerolog.Nop())
	if err != nil || r != nil {
		t.Fatalf("rank 1: reporter %v, %v", r, err)
	}
	if err := r.perftestHere(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	r.begin(2, nil)
	r.add(1, Case{}, []Row{{}})
	r.abandon()
	if rep, err := r.finish(); rep != nil || err != nil {
		t.Fatalf("rank 1 finished with %v, %v", rep, err)
	}
	if !strings.Contains(loadNote(float64(runtime.NumCPU())), "LOADED") || strings.Contains(loadNote(0), "LOADED") {
		t.Errorf("load notes: %q, %q", loadNote(float64(runtime.NumCPU())), loadNote(0))
	}
}
