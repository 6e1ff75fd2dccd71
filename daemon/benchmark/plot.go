package benchmark

import (
	"bytes"
	"fmt"
	"image/color"
	"io"
	"math"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgpdf"
	"gonum.org/v1/plot/vg/vgsvg"
)

// sizeTicks labels a log2 axis of byte sizes (8B, 1KiB, 1MiB, ...), with
// at most about eight labels and a minor tick at every power of two.
type sizeTicks struct{}

func (sizeTicks) Ticks(lo, hi float64) []plot.Tick {
	a, b := int(math.Floor(math.Log2(lo))), int(math.Ceil(math.Log2(hi)))
	step := max(1, (b-a+7)/8)
	var ts []plot.Tick
	for e := a; e <= b; e++ {
		t := plot.Tick{Value: math.Exp2(float64(e))}
		if (e-a)%step == 0 {
			t.Label = fmtBytes(int64(t.Value))
		}
		ts = append(ts, t)
	}
	return ts
}

// logTicks labels a log10 axis with 1-2-5 steps when it spans little.
type logTicks struct{}

func (logTicks) Ticks(lo, hi float64) []plot.Tick {
	var ts []plot.Tick
	for e := int(math.Floor(math.Log10(lo))); e <= int(math.Ceil(math.Log10(hi))); e++ {
		base := math.Pow10(e)
		for m := 1; m < 10; m++ {
			t := plot.Tick{Value: float64(m) * base}
			if m == 1 || ((m == 2 || m == 5) && math.Log10(hi/lo) < 3) {
				t.Label = strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.6f", t.Value), "0"), ".")
			}
			ts = append(ts, t)
		}
	}
	return ts
}

type series struct {
	name   string
	pts    plotter.XYs
	color  color.Color
	dashes []vg.Length
}

var palette = []color.Color{
	color.RGBA{0x1f, 0x77, 0xb4, 0xff}, // forward
	color.RGBA{0xd6, 0x27, 0x28, 0xff}, // backward
	color.RGBA{0x33, 0x33, 0x33, 0xff}, // ucx_perftest
}

func opColor(op string) color.Color {
	if op == "backward" {
		return palette[1]
	}
	return palette[0]
}

func newPanel(title, ylabel string) *plot.Plot {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "halo size per side"
	p.Y.Label.Text = ylabel
	p.X.Scale, p.Y.Scale = plot.LogScale{}, plot.LogScale{}
	p.X.Tick.Marker, p.Y.Tick.Marker = sizeTicks{}, logTicks{}
	p.Legend.Top, p.Legend.Left = true, true
	p.Add(plotter.NewGrid())
	return p
}

func addSeries(p *plot.Plot, ss []series) error {
	for _, s := range ss {
		var pts plotter.XYs
		for _, q := range s.pts {
			if q.X > 0 && q.Y > 0 && !math.IsInf(q.Y, 0) && !math.IsNaN(q.Y) {
				pts = append(pts, q)
			}
		}
		if len(pts) == 0 {
			continue
		}
		line, scatter, err := plotter.NewLinePoints(pts)
		if err != nil {
			return err
		}
		line.Color, line.Dashes, line.Width = s.color, s.dashes, vg.Points(1.5)
		scatter.Color, scatter.Radius = s.color, vg.Points(2)
		p.Add(line, scatter)
		p.Legend.Add(s.name, line, scatter)
	}
	return nil
}

// drawPlot draws bandwidth and latency against size, ours beside
// ucx_perftest's when it ran, and writes PNG, SVG or PDF by the file name.
func drawPlot(path string, m *Meta, rows []Row) error {
	ops := map[string][]Row{}
	var order []string
	for _, r := range rows {
		if _, ok := ops[r.Op]; !ok {
			order = append(order, r.Op)
		}
		ops[r.Op] = append(ops[r.Op], r)
	}
	var bw, lat []series
	dotted := []vg.Length{vg.Points(2), vg.Points(2)}
	dashed := []vg.Length{vg.Points(6), vg.Points(3)}
	for _, op := range order {
		var b, p50, p99 plotter.XYs
		for _, r := range ops[op] {
			x := float64(r.Bytes)
			b = append(b, plotter.XY{X: x, Y: r.BusBW})
			p50 = append(p50, plotter.XY{X: x, Y: r.P50US})
			p99 = append(p99, plotter.XY{X: x, Y: r.P99US})
		}
		c := opColor(op)
		bw = append(bw, series{name: "halo " + op + " busbw", pts: b, color: c})
		lat = append(lat, series{name: "halo " + op + " p50", pts: p50, color: c},
			series{name: "halo " + op + " p99", pts: p99, color: c, dashes: dotted})
	}
	var pb, pl plotter.XYs
	seen := map[int64]bool{}
	for _, r := range rows {
		if p := r.Perftest; p != nil && p.Error == "" && !seen[p.Bytes] {
			seen[p.Bytes] = true
			pb = append(pb, plotter.XY{X: float64(p.Bytes), Y: p.BWGBs})
			pl = append(pl, plotter.XY{X: float64(p.Bytes), Y: p.LatencyUS})
		}
	}
	if len(pb) > 0 {
		bw = append(bw, series{name: "ucx_perftest tag_bw", pts: pb, color: palette[2], dashes: dashed})
		lat = append(lat, series{name: "ucx_perftest tag_lat p50", pts: pl, color: palette[2], dashes: dashed})
	}

	who := fmt.Sprintf("%d ranks, %s", m.WorldSize, m.Options.DType)
	left := newPanel("Bus bandwidth ("+who+")", "GB/s (1e9 B/s)")
	right := newPanel("Latency of one call ("+who+")", "time (µs)")
	if err := addSeries(left, bw); err != nil {
		return err
	}
	if err := addSeries(right, lat); err != nil {
		return err
	}
	// Head room on the log axes, so that the legends sit above the data.
	for _, p := range []*plot.Plot{left, right} {
		if p.Y.Max > 0 && p.Y.Min > 0 {
			p.Y.Max *= math.Pow(p.Y.Max/p.Y.Min, 0.35)
		}
	}

	const w, h = 30 * vg.Centimeter, 12 * vg.Centimeter
	var c interface {
		vg.CanvasSizer
		io.WriterTo
	}
	switch strings.ToLower(filepath.Ext(path)) {
	case ".svg":
		c = vgsvg.New(w, h)
	case ".pdf":
		c = vgpdf.New(w, h)
	default:
		c = vgimg.PngCanvas{Canvas: vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(120), vgimg.UseBackgroundColor(color.White))}
	}
	dc := draw.New(c)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Centimeter, PadY: vg.Millimeter * 4,
		PadLeft: vg.Millimeter * 4, PadRight: vg.Millimeter * 6, PadTop: vg.Millimeter * 4, PadBottom: vg.Millimeter * 4}
	canvases := plot.Align([][]*plot.Plot{{left, right}}, tiles, dc)
	left.Draw(canvases[0][0])
	right.Draw(canvases[0][1])
	var buf bytes.Buffer
	if _, err := c.WriteTo(&buf); err != nil {
		return err
	}
	return writeFileAtomic(path, buf.Bytes())
}
