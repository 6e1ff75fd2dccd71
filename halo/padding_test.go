package halo_test

import (
	"errors"
	"math/rand"
	"strings"
	"testing"
	"time"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

var paddingModes = []Padding{PadReplicate, PadReflect, PadCircular}

// fitPadding shortens c's halos to what its mode allows for the global
// length (torch's rules), so that random cases are valid plans.
func fitPadding(c *caseSpec) {
	var T int64
	for _, n := range c.lengths {
		T += n
	}
	switch c.padding {
	case PadReplicate:
		if T == 0 {
			c.L, c.R = 0, 0
		}
	case PadReflect:
		c.L, c.R = min(c.L, max(T-1, 0)), min(c.R, max(T-1, 0))
	case PadCircular:
		c.L, c.R = min(c.L, T), min(c.R, T)
	}
}

// Every mode on 1 to 4 ranks, uneven shards (some empty or of one slice),
// halos longer than shards, padded, in place, halos-only, strided and
// asynchronous, every dtype: bit for bit against the oracle.
func TestPaddingModesRandom(t *testing.T) {
	rng := rand.New(rand.NewSource(11))
	n := 120
	if testing.Short() {
		n = 30
	}
	for i := 0; i < n; i++ {
		c := randomCase(rng)
		c.W = 1 + i%4
		c.lengths = make([]int64, c.W)
		for r := range c.lengths {
			c.lengths[r] = int64(rng.Intn(5))
		}
		c.padding = paddingModes[i%3]
		fitPadding(&c)
		opts := GroupOptions{Timeout: 10 * time.Second, Transfer: Transfer(rng.Intn(3)), IOVMinSegment: int64(1 + rng.Intn(64))}
		checkCase(t, rng, c, opts)
	}
}

// The corners: a rank its own neighbour, halos as long as torch allows,
// sources two ranks away, a rank both left and right source of another,
// many slots summed into one edge slice (float32, where order shows).
func TestPaddingModesCases(t *testing.T) {
	rng := rand.New(rand.NewSource(12))
	for _, mode := range paddingModes {
		for _, c := range []caseSpec{
			{W: 1, dtype: Float32, shape: []int64{2, 5, 3}, lengths: []int64{5}, dim: 1, L: 4, R: 4},
			{W: 2, dtype: Float32, shape: []int64{3, 4}, lengths: []int64{1, 4}, dim: 0, L: 4, R: 3},
			{W: 3, dtype: Float64, shape: []int64{2, 1, 3}, lengths: []int64{1, 1, 1}, dim: 1, L: 2, R: 2},
			{W: 4, dtype: Float32, shape: []int64{3, 2}, lengths: []int64{0, 3, 1, 0}, dim: 0, L: 3, R: 3},
			{W: 4, dtype: Float32, shape: []int64{2, 7}, lengths: []int64{2, 1, 3, 1}, dim: 1, L: 6, R: 6},
			{W: 2, dtype: BFloat16, shape: []int64{1, 3, 5, 4, 4}, lengths: []int64{5, 5}, dim: 2, L: 1, R: 1},
			{W: 3, dtype: Float16, shape: []int64{4, 6, 2}, lengths: []int64{6, 2, 6}, dim: 1, L: 3, R: 2},
		} {
			c.padding = mode
			fitPadding(&c)
			for _, v := range []struct{ inPlace, strided, halos bool }{{false, false, false}, {true, true, false}, {false, true, true}} {
				c.inPlace, c.strided, c.halos = v.inPlace, v.strided, v.halos
				checkCase(t, rng, c, GroupOptions{Timeout: 10 * time.Second})
			}
		}
	}
	// Replicate with a long halo on a one-slice sequence: every slot of both
	// sides sums into slice 0, with values spread over many magnitudes.
	checkCase(t, rng, caseSpec{W: 3, dtype: Float32, shape: []int64{2, 3}, lengths: []int64{0, 1, 0}, dim: 1, L: 9, R: 7,
		padding: PadReplicate}, GroupOptions{Timeout: 10 * time.Second})
}

// Layouts of different modes in one plan travel in one message per peer.
func TestPaddingModesMulti(t *testing.T) {
	rng := rand.New(rand.NewSource(13))
	for i := 0; i < 12; i++ {
		W := 1 + i%4
		halos := i%3 == 2
		cases := make([]caseSpec, 1+rng.Intn(3))
		for k := range cases {
			c := randomCase(rng)
			c.W, c.halos, c.async, c.inPlace = W, halos, false, false
			c.lengths = make([]int64, W)
			for r := range c.lengths {
				c.lengths[r] = int64(rng.Intn(5))
			}
			c.padding = Padding(rng.Intn(4))
			fitPadding(&c)
			cases[k] = c
		}
		checkMulti(t, rng, cases)
	}
}

// Halos the sequence cannot serve fail creation on every rank with one
// message naming the mode, the halos and the global length.
func TestPaddingInvalid(t *testing.T) {
	for _, tc := range []struct {
		mode    Padding
		lengths []int64
		L, R    int64
		want    string
	}{
		{PadReflect, []int64{2, 1}, 3, 0, "reflect padding needs halos shorter than the sequence: left halo 3, right halo 0, global length 3 along dim 1"},
		{PadReflect, []int64{1, 0}, 0, 1, "global length 1"},
		{PadCircular, []int64{2, 2}, 1, 5, "circular padding needs halos no longer than the sequence: left halo 1, right halo 5, global length 4"},
		{PadReplicate, []int64{0, 0}, 1, 0, "replicate padding needs a non-empty sequence"},
	} {
		errs := halotest.Groups(len(tc.lengths), GroupOptions{Timeout: 5 * time.Second}, func(g *Group) error {
			p, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{2, tc.lengths[g.Rank()]}, Dim: 1, Left: tc.L, Right: tc.R, Padding: tc.mode})
			if err == nil {
				p.Close()
			}
			return err
		})
		for r, err := range errs {
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v: rank %d: got %v, want ErrInvalid containing %q", tc.mode, r, err, tc.want)
			}
		}
	}
	errs := halotest.Groups(2, GroupOptions{Timeout: 5 * time.Second}, func(g *Group) error {
		s := Spec{DType: Float32, Shape: []int64{4}, Dim: 0, Left: 1, Right: 1, Padding: PadReflect}
		if g.Rank() == 1 {
			s.Padding = PadCircular
		}
		p, err := g.NewPlan(s)
		if err == nil {
			p.Close()
		}
		return err
	})
	for r, err := range errs {
		if want := "padding: reflect on rank 0, circular on rank 1"; !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), want) {
			t.Errorf("mismatch: rank %d: got %v, want ErrMismatch containing %q", r, err, want)
		}
	}
}
