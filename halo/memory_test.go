package halo_test

import (
	"errors"
	"math"
	"strings"
	"testing"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// cudaSpec is a halos-only float32 layout (rows, n) sharded along dim 1.
func cudaSpec(rows, n, L, R int64) Spec {
	return Spec{DType: Float32, Shape: []int64{rows, n}, Dim: 1, Left: L, Right: R, HalosOnly: true, Memory: MemoryCUDA}
}

// cudaPlans makes spec(r)'s plan on every rank of a fresh in-memory group
// of w ranks whose transports move CUDA memory on the ranks in cuda, and
// returns each rank's error.
func cudaPlans(w int, cuda []int, spec func(rank int) Spec) []error {
	hub := halotest.NewMemHub(w)
	hub.MovesCUDA(cuda...)
	return halotest.Ranks(w, func(r int) error {
		g, err := NewGroup(hub.Transport(r), GroupOptions{})
		if err != nil {
			return err
		}
		_, err = g.NewPlan(spec(r))
		return err
	})
}

func TestCUDAPlanNeedsATransportThatMovesIt(t *testing.T) {
	// Neither rank's transport moves CUDA memory, then only rank 1's: every
	// rank fails alike, naming the ranks that cannot and what to do.
	for _, cuda := range [][]int{nil, {1}} {
		errs := cudaPlans(2, cuda, func(int) Spec { return cudaSpec(2, 3, 1, 1) })
		want := "transport of ranks 0-1 cannot move cuda memory"
		if cuda != nil {
			want = "transport of rank 0 cannot move cuda memory"
		}
		for r, err := range errs {
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "--with-cuda") {
				t.Errorf("cuda on %v: rank %d: %v, want ErrInvalid with %q", cuda, r, err, want)
			}
		}
	}
}

func TestCUDAPlanIsHalosOnlyAndAgreed(t *testing.T) {
	g := halotest.Group(GroupOptions{})
	s := cudaSpec(1, 4, 1, 1)
	s.HalosOnly = false
	if _, err := g.NewPlan(s); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "must be halos-only") {
		t.Errorf("padded CUDA plan: %v", err)
	}
	s = cudaSpec(1, 4, 1, 1)
	s.Padding = PadReplicate
	if _, err := g.NewPlan(s); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "pads with zeros only") {
		t.Errorf("CUDA plan with replicate padding: %v", err)
	}
	s = cudaSpec(1, 4, 1, 1)
	s.Memory = 7
	if _, err := g.NewPlan(s); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "unknown memory type 7") {
		t.Errorf("memory type 7: %v", err)
	}
	// Ranks that disagree on the memory type are told so, all of them.
	errs := cudaPlans(2, []int{0, 1}, func(r int) Spec {
		s := cudaSpec(1, 4, 1, 1)
		if r == 1 {
			s.Memory = MemoryHost
		}
		return s
	})
	for r, err := range errs {
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "memory type: cuda on rank 0, host on rank 1") {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

func TestCUDAPlanRefusesSlicesSentTwice(t *testing.T) {
	// Left halos of 3 over shards of 2: rank 0's slices go to ranks 1 and 2;
	// shards of 2 with halos 1 + 2: one slice goes both ways.
	for _, c := range []struct {
		L, R int64
		want string
	}{{3, 0, "sent at most once"}, {1, 2, "left + right no longer than any shard"}} {
		errs := cudaPlans(3, []int{0, 1, 2}, func(int) Spec { return cudaSpec(1, 2, c.L, c.R) })
		for r, err := range errs {
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
				t.Errorf("L=%d R=%d: rank %d: %v", c.L, c.R, r, err)
			}
		}
	}
}

// TestCUDAPlanMovesBytesOnly runs a CUDA plan over host memory (the
// in-memory transport copies any bytes): the halos arrive, slices outside
// the sequence and every slice of grad_x that nothing arrives for keep what
// the caller put there, and the neighbours' gradients are written, not added.
func TestCUDAPlanMovesBytesOnly(t *testing.T) {
	const rows, untouched = 2, -7
	lengths := []int64{4, 3, 5}
	L, R := int64(2), int64(1)
	var off []int64
	total := int64(0)
	for _, n := range lengths {
		off = append(off, total)
		total += n
	}
	// Global values: x at (row, pos) is 1000*row + pos; the halo gradient
	// rank r sends for global position pos is 100000*(r+1) + that.
	val := func(row, pos int64) float32 { return float32(1000*row + pos) }
	hub := halotest.NewMemHub(3)
	hub.MovesCUDA(0, 1, 2)
	errs := halotest.Ranks(3, func(r int) error {
		g, err := NewGroup(hub.Transport(r), GroupOptions{})
		if err != nil {
			return err
		}
		n := lengths[r]
		p, err := g.NewPlan(cudaSpec(rows, n, L, R))
		if err != nil {
			return err
		}
		defer p.Close()
		fill := func(k int64, f func(row, i int64) float32) []float32 {
			b := make([]float32, rows*k)
			for row := int64(0); row < rows; row++ {
				for i := int64(0); i < k; i++ {
					b[row*k+i] = f(row, i)
				}
			}
			return b
		}
		x := fill(n, func(row, i int64) float32 { return val(row, off[r]+i) })
		left := fill(L, func(int64, int64) float32 { return untouched })
		right := fill(R, func(int64, int64) float32 { return untouched })
		if err := p.Do(CallHalosForward, true, PtrOf(x), PtrOf(left), PtrOf(right)); err != nil {
			return err
		}
		check := func(name string, got []float32, k int64, want func(row, i int64) float32) {
			for row := int64(0); row < rows; row++ {
				for i := int64(0); i < k; i++ {
					if g, w := got[row*k+i], want(row, i); g != w {
						t.Errorf("rank %d: %s[%d, %d] = %v, want %v", r, name, row, i, g, w)
					}
				}
			}
		}
		inside := func(pos int64, row int64) float32 {
			if pos < 0 || pos >= total {
				return untouched
			}
			return val(row, pos)
		}
		check("left", left, L, func(row, i int64) float32 { return inside(off[r]-L+i, row) })
		check("right", right, R, func(row, i int64) float32 { return inside(off[r]+n+i, row) })

		tagged := func(pos int64, row int64) float32 { return float32(100000*(r+1)) + val(row, pos) }
		gl := fill(L, func(row, i int64) float32 { return tagged(off[r]-L+i, row) })
		gr := fill(R, func(row, i int64) float32 { return tagged(off[r]+n+i, row) })
		gx := fill(n, func(int64, int64) float32 { return untouched })
		if err := p.Do(CallHalosBackward, true, PtrOf(gl), PtrOf(gr), PtrOf(gx)); err != nil {
			return err
		}
		check("grad_x", gx, n, func(row, i int64) float32 {
			pos := off[r] + i
			switch {
			case r < 2 && i >= n-L: // the right neighbour's left-halo gradient
				return float32(100000*(r+2)) + val(row, pos)
			case r > 0 && i < R: // the left neighbour's right-halo gradient
				return float32(100000*r) + val(row, pos)
			}
			return untouched
		})
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestCUDAPlanLeavesGradXToTheCaller: the slices of grad_x that no gradient
// arrives for keep their bits, -0 included (the caller adds +0 where the
// reference would; the CPU must not touch CUDA memory).
func TestCUDAPlanLeavesGradXToTheCaller(t *testing.T) {
	const n = 4
	negZero := math.Float32frombits(1 << 31)
	hub := halotest.NewMemHub(2)
	hub.MovesCUDA(0, 1)
	errs := halotest.Ranks(2, func(r int) error {
		g, err := NewGroup(hub.Transport(r), GroupOptions{})
		if err != nil {
			return err
		}
		p, err := g.NewPlan(cudaSpec(1, n, 1, 1))
		if err != nil {
			return err
		}
		defer p.Close()
		gl, gr, gx := []float32{1}, []float32{2}, make([]float32, n)
		for i := range gx {
			gx[i] = negZero
		}
		if err := p.Do(CallHalosBackward, true, PtrOf(gl), PtrOf(gr), PtrOf(gx)); err != nil {
			return err
		}
		for i, v := range gx {
			if (r == 0 && i == n-1) || (r == 1 && i == 0) {
				continue // a neighbour's gradient arrives here
			}
			if math.Float32bits(v) != 1<<31 {
				t.Errorf("rank %d: grad_x[%d] = %v (bits %#x), want -0 untouched", r, i, v, math.Float32bits(v))
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}
