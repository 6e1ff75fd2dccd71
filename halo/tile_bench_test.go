package halo_test

import (
	"testing"
	"time"
	"unsafe"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// The two steps of a tile's padding (bench/torch_tiles.py) in the core
// alone: 2 ranks in one process (the in-memory transport), a (1, 32, 64,
// 64) float32 tile, halo 1; the H step pads along H, the W step pads the
// H-padded (1, 32, 66, 64) tile along W, whose halos are 2112 runs of one
// element (contiguous) where the H step's are 32 runs of 64. Forward and
// backward, in rounds that alternate the two steps; each line reports the
// best round's µs per exchange of the W step, of the H step, and their
// ratio.
func BenchmarkTileSteps(b *testing.B) {
	for _, format := range []string{"contiguous", "channels_last"} {
		b.Run(format, func(b *testing.B) {
			order := []int{0, 1, 2, 3}
			if format == "channels_last" {
				order = []int{0, 2, 3, 1}
			}
			var w, h [2]float64 // forward, backward µs, rank 0's
			errs := halotest.Groups(2, GroupOptions{Timeout: 10 * time.Second}, func(g *Group) error {
				steps := [2]struct {
					p           *Plan
					x, out, gx  []byte
					dim, length int64
				}{}
				for i, sh := range [][]int64{{1, 32, 64, 64}, {1, 32, 66, 64}} {
					dim := 2 + i
					osh := append([]int64(nil), sh...)
					osh[dim] += 2
					s := Spec{DType: Float32, Shape: sh, Dim: dim, Left: 1, Right: 1,
						XStrides: StridesInOrder(sh, order), OutStrides: StridesInOrder(osh, order),
						GradOutStrides: StridesInOrder(osh, order), GradXStrides: StridesInOrder(sh, order)}
					p, err := g.NewPlan(s)
					if err != nil {
						return err
					}
					defer p.Close()
					st := &steps[i]
					st.p = p
					st.x, st.gx = make([]byte, 4*Numel(sh)), make([]byte, 4*Numel(sh))
					st.out = make([]byte, 4*Numel(osh))
				}
				best := [2][2]float64{{1e9, 1e9}, {1e9, 1e9}}
				for round := 0; round < 15+b.N/50; round++ {
					for i := range steps {
						st := &steps[i]
						x, out, gx := unsafe.Pointer(&st.x[0]), unsafe.Pointer(&st.out[0]), unsafe.Pointer(&st.gx[0])
						for pass := range 2 {
							t0 := time.Now()
							for range 20 {
								var err error
								if pass == 0 {
									err = st.p.Do(CallForward, true, x, out, nil)
								} else {
									err = st.p.Do(CallBackward, true, out, gx, nil)
								}
								if err != nil {
									return err
								}
							}
							best[i][pass] = min(best[i][pass], time.Since(t0).Seconds()*1e6/20)
						}
					}
				}
				if g.Rank() == 0 {
					h, w = best[0], best[1]
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					b.Fatalf("rank %d: %v", r, err)
				}
			}
			b.ReportMetric(w[0], "W-fwd-us")
			b.ReportMetric(h[0], "H-fwd-us")
			b.ReportMetric(w[0]/h[0], "W/H-fwd")
			b.ReportMetric(w[1], "W-bwd-us")
			b.ReportMetric(h[1], "H-bwd-us")
			b.ReportMetric(w[1]/h[1], "W/H-bwd")
		})
	}
}
