package halo_test

import (
	"testing"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// Two 2 KiB forwards in flight on 2 in-process ranks, started together and
// waited in order, with nothing to agree on: the steady state of
// overlapping layers. The first wait polls until the second exchange's
// messages have come (it might need this rank's agreement), then waits.
func BenchmarkTwoInFlight2KiB(b *testing.B) {
	errs := halotest.Groups(2, GroupOptions{}, func(g *Group) error {
		var plans [2]*Plan
		var xs, outs [2][]float32
		for k := range plans {
			var err error
			if plans[k], err = g.NewPlan(Spec{DType: Float32, Shape: []int64{1, 512}, Dim: 0, Left: 1, Right: 1}); err != nil {
				return err
			}
			outs[k] = make([]float32, 3*512)
			xs[k] = outs[k][512:1024]
		}
		for i := 0; i < b.N; i++ {
			for k, p := range plans {
				if err := p.Do(CallForward, false, PtrOf(xs[k]), PtrOf(outs[k]), nil); err != nil {
					return err
				}
			}
			for _, p := range plans {
				if err := p.Wait(DirForward); err != nil {
					return err
				}
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			b.Fatalf("rank %d: %v", r, err)
		}
	}
}
