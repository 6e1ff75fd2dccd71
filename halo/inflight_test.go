package halo_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// Several exchanges in flight whose ranks must agree again (their shard
// lengths changed, or their plans are deferred): whatever order each rank
// finishes them in, by Wait or by polling Test, every one finishes, with the
// right values, well before the deadline. Agreement inside one call used to
// block that call while the peer blocked in another call's agreement, until
// both timed out.

// flight is one rank's exchanges of a step: one per layout, each on the plan
// its rank's cache gives for its own length (a deferred plan on a miss).
type flight struct {
	g       *Group
	lengths [][]int64 // per layout, every rank's
	plans   []*Plan
	x, out  [][]float64
	gout    [][]float64
	gx      [][]float64
}

// Halo sizes per layout: the layouts differ, so the plans do.
var flightHalos = [][2]int64{{2, 1}, {1, 1}, {0, 2}}

func newFlight(g *Group, cache map[string]*Plan, lengths [][]int64) (*flight, error) {
	me := g.Rank()
	f := &flight{g: g, lengths: lengths}
	for k, ls := range lengths {
		L, R := flightHalos[k][0], flightHalos[k][1]
		n := ls[me]
		key := fmt.Sprint(k, ":", n)
		p := cache[key]
		if p == nil {
			var err error
			if p, err = g.NewDeferredPlan([]Spec{{DType: Float64, Shape: []int64{n}, Dim: 0, Left: L, Right: R}}); err != nil {
				return nil, err
			}
			cache[key] = p
		}
		xs, _, gouts, _ := seqOracle(ls, L, R)
		// One element more than needed: PtrOf needs one, even for an empty shard.
		f.plans = append(f.plans, p)
		f.x = append(f.x, append(xs[me], 0))
		f.out = append(f.out, make([]float64, L+n+R+1))
		f.gout = append(f.gout, append(gouts[me], 0))
		f.gx = append(f.gx, make([]float64, n+1))
	}
	return f, nil
}

func (f *flight) start(k int, d Direction) error {
	if d == DirForward {
		return f.plans[k].Do(CallForward, false, PtrOf(f.x[k]), PtrOf(f.out[k]), nil)
	}
	return f.plans[k].Do(CallBackward, false, PtrOf(f.gout[k]), PtrOf(f.gx[k]), nil)
}

// check compares layout k's results of direction d with the whole sequence's.
func (f *flight) check(k int, d Direction) error {
	me, L, R := f.g.Rank(), flightHalos[k][0], flightHalos[k][1]
	_, outs, _, gxs := seqOracle(f.lengths[k], L, R)
	n := f.lengths[k][me]
	got, want := f.out[k][:L+n+R], outs[me]
	if d == DirBackward {
		got, want = f.gx[k][:n], gxs[me]
	}
	if !slices.Equal(got, want) {
		return fmt.Errorf("layout %d lengths %v: rank %d: %v %v, want %v", k, f.lengths[k], me, []string{"out", "grad_x"}[d], got, want)
	}
	return nil
}

// An action on one rank: start (s), wait (w; nothing if a Test has finished
// it), test once (t), or poll Test until done (p), of layout k in the step's
// direction; or create a plan collectively (c).
type action struct {
	op byte
	k  int
}

func actions(s string) []action {
	var as []action
	for i := 0; i+1 < len(s); i += 3 {
		as = append(as, action{s[i], int(s[i+1] - '0')})
	}
	return as
}

// run does a rank's actions for direction d and checks every layout that
// finished.
func (f *flight) run(as []action, d Direction) error {
	for _, a := range as {
		var err error
		switch a.op {
		case 's':
			err = f.start(a.k, d)
		case 'w':
			if f.plans[a.k].InFlight(d) { // else a Test finished it
				err = f.plans[a.k].Wait(d)
			}
		case 't':
			_, err = f.plans[a.k].Test(d)
		case 'p':
			deadline := time.Now().Add(3 * time.Second)
			for done := false; !done && err == nil; {
				if time.Now().After(deadline) {
					return fmt.Errorf("layout %d: Test never reported done", a.k)
				}
				done, err = f.plans[a.k].Test(d)
			}
		case 'c':
			var p *Plan
			if p, err = f.g.NewPlan(Spec{DType: Float32, Shape: []int64{2}, Dim: 0, Left: 1, Right: 1}); err == nil {
				err = p.Close()
			}
		}
		if err != nil {
			return fmt.Errorf("%c%d: %w", a.op, a.k, err)
		}
		if a.op == 'w' || a.op == 'p' {
			if err := f.check(a.k, d); err != nil {
				return err
			}
		}
	}
	for k, p := range f.plans {
		if p.InFlight(d) {
			return fmt.Errorf("layout %d still in flight after the rank's calls", k)
		}
	}
	return nil
}

// inflightSteps are every rank's lengths per step and layout, per world
// size: first all deferred, then a rank whose own length repeats reuses its
// plan while a peer makes a new one, then a step that agrees on kept
// instances, then a steady one (nothing changed).
var inflightSteps = map[int][][][]int64{
	2: {
		{{3, 3}, {2, 2}},
		{{3, 5}, {2, 3}},
		{{0, 4}, {4, 1}},
		{{3, 1}, {2, 2}},
		{{3, 1}, {2, 2}},
	},
	3: {
		{{3, 3, 1}, {2, 2, 2}},
		{{3, 5, 1}, {2, 3, 2}},
		{{0, 4, 2}, {4, 1, 0}},
		{{3, 1, 1}, {2, 2, 2}},
		{{3, 1, 1}, {2, 2, 2}},
	},
}

func TestInFlightAgreementsAnyOrder(t *testing.T) {
	cases := []struct {
		name string
		rank [2]string // per rank (by parity): its actions, as "s0 s1 w0 w1"
	}{
		// rank 0 waits the first then the second, rank 1 the other way round.
		{"wait_orders", [2]string{"s0 s1 w0 w1", "s0 s1 w1 w0"}},
		// A Test on the second, then a wait on the first (halocp's
		// h2.test(); h1.wait()); one rank polls until the second is done.
		{"test_then_wait", [2]string{"s0 s1 t1 w0 w1", "s0 s1 t1 w0 w1"}},
		{"poll_second", [2]string{"s0 s1 p1 w0", "s0 s1 w0 w1"}},
		{"poll_crossed", [2]string{"s0 s1 p1 p0", "s0 s1 p0 p1"}},
		// One rank finishes the first before it starts the second.
		{"start_after_wait", [2]string{"s0 w0 s1 w1", "s0 s1 w1 w0"}},
		// A plan creation, collective and blocking, between a start and its wait.
		{"create_between", [2]string{"s0 c0 w0", "s0 w0 c0"}},
		// Three in flight.
		{"three", [2]string{"s0 s1 s2 w2 w0 w1", "s0 s1 s2 p1 w2 w0"}},
	}
	for _, c := range cases {
		for _, W := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s_W%d", c.name, W), func(t *testing.T) {
				checkInFlight(t, W, c.rank)
			})
		}
	}
}

// inFlightGroups runs fn on every rank of a group of W under a short
// deadline, and fails t for each rank's error and if the whole took half
// the deadline (a rank waited for it).
func inFlightGroups(t *testing.T, W int, fn func(g *Group) error) {
	t.Helper()
	const timeout = 3 * time.Second
	begin := time.Now()
	errs := halotest.Groups(W, GroupOptions{Timeout: timeout}, fn)
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
	if d := time.Since(begin); d > timeout/2 {
		t.Errorf("took %v: a rank waited for a deadline", d)
	}
}

// checkInFlight runs every step of inflightSteps[W], forward then backward,
// each rank doing the actions of its parity.
func checkInFlight(t *testing.T, W int, rank [2]string) {
	inFlightGroups(t, W, func(g *Group) error {
		cache := map[string]*Plan{}
		as := actions(rank[g.Rank()%2])
		for i, ls := range inflightSteps[W] {
			third := make([]int64, W) // a third layout for "three"
			for r := range third {
				third[r] = int64(1 + (i+r)%2)
			}
			ls = append(ls, third)
			for _, d := range []Direction{DirForward, DirBackward} {
				f, err := newFlight(g, cache, ls)
				if err != nil {
					return err
				}
				if err := f.run(as, d); err != nil {
					return fmt.Errorf("step %d %v: %w", i, []string{"forward", "backward"}[d], err)
				}
			}
		}
		return nil
	})
}

// The forward and backward of one plan in flight together, both agreeing
// again, finished in opposite orders on the two ranks.
func TestInFlightBothDirectionsOfOnePlan(t *testing.T) {
	inFlightGroups(t, 2, func(g *Group) error {
		cache := map[string]*Plan{}
		for i, ls := range inflightSteps[2] {
			f, err := newFlight(g, cache, ls[:1])
			if err != nil {
				return err
			}
			if err := f.start(0, DirForward); err != nil {
				return err
			}
			if err := f.start(0, DirBackward); err != nil {
				return err
			}
			order := []Direction{DirForward, DirBackward}
			if g.Rank() == 1 {
				order = []Direction{DirBackward, DirForward}
			}
			for _, d := range order {
				if err := f.plans[0].Wait(d); err != nil {
					return fmt.Errorf("step %d: %w", i, err)
				}
				if err := f.check(0, d); err != nil {
					return fmt.Errorf("step %d: %w", i, err)
				}
			}
		}
		return nil
	})
}

// A true disagreement on one of two exchanges in flight, found while the
// other's wait progresses it: that exchange's own wait gets MISMATCH on
// every rank, the other one finishes, and the group stays usable.
func TestInFlightMismatchGoesToItsOwnCall(t *testing.T) {
	inFlightGroups(t, 2, func(g *Group) error {
		cache := map[string]*Plan{}
		f, err := newFlight(g, cache, [][]int64{{3, 2}})
		if err != nil {
			return err
		}
		// Float32 on rank 0, float64 on rank 1.
		bad, err := g.NewDeferredPlan([]Spec{{DType: []DType{Float32, Float64}[g.Rank()], Shape: []int64{2}, Dim: 0, Left: 1, Right: 1}})
		if err != nil {
			return err
		}
		x, out := make([]float64, 2), make([]float64, 4)
		if err := f.start(0, DirForward); err != nil {
			return err
		}
		if err := bad.Do(CallForward, false, PtrOf(x), PtrOf(out), nil); err != nil {
			return err
		}
		waitBad := func() error {
			if err := bad.Wait(DirForward); !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "dtype: float32 on rank 0, float64 on rank 1") {
				return fmt.Errorf("the disagreeing exchange: got %v, want MISMATCH naming the dtypes", err)
			}
			return nil
		}
		if g.Rank() == 1 {
			if err := waitBad(); err != nil {
				return err
			}
		}
		if err := f.plans[0].Wait(DirForward); err != nil {
			return err
		}
		if err := f.check(0, DirForward); err != nil {
			return err
		}
		if g.Rank() == 0 {
			if err := waitBad(); err != nil {
				return err
			}
		}
		if err := g.Err(); err != nil {
			return fmt.Errorf("the group failed: %v", err)
		}
		return f.run(actions("s0 w0"), DirBackward)
	})
}
