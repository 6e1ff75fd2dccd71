package halo_test

import (
	"testing"
	"time"
	"unsafe"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// The per-step path must not allocate: plans exist so that every step only
// moves bytes. (Transport calls are excluded: a one-rank group has none.)
func TestForwardBackwardDoNotAllocate(t *testing.T) {
	g := halotest.Group(GroupOptions{Timeout: time.Second})
	shape := []int64{4, 8, 16}
	p, err := g.NewPlan(Spec{DType: BFloat16, Shape: shape, Dim: 1, Left: 2, Right: 1,
		XStrides: []int64{1, 4 * 16, 4}})
	if err != nil {
		t.Fatal(err)
	}
	x := make([]uint16, 4*8*16)
	out := make([]uint16, 4*11*16)
	gx := make([]uint16, len(x))
	xp, op, gp := unsafe.Pointer(&x[0]), unsafe.Pointer(&out[0]), unsafe.Pointer(&gx[0])
	if n := testing.AllocsPerRun(100, func() {
		if err := p.Do(CallForward, true, xp, op, nil); err != nil {
			t.Fatal(err)
		}
		if err := p.Do(CallBackward, true, op, gp, nil); err != nil {
			t.Fatal(err)
		}
	}); n != 0 {
		t.Errorf("%v allocations per forward+backward", n)
	}
}
