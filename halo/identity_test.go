package halo_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

// seqOracle is the exchange of a 1-D float64 sequence x[i] = i+1 sharded by
// lengths, with zeros padding: every rank's padded output, and its gradient
// for grad_out[r][j] = 1000r + j + 0.5.
func seqOracle(lengths []int64, L, R int64) (xs, outs, gouts, gxs [][]float64) {
	var N int64
	offs := make([]int64, len(lengths))
	for r, n := range lengths {
		offs[r] = N
		N += n
	}
	xs, outs, gouts, gxs = make([][]float64, len(lengths)), make([][]float64, len(lengths)), make([][]float64, len(lengths)), make([][]float64, len(lengths))
	for r, n := range lengths {
		xs[r], gxs[r] = make([]float64, n), make([]float64, n)
		for i := range xs[r] {
			xs[r][i] = float64(offs[r] + int64(i) + 1)
		}
		outs[r], gouts[r] = make([]float64, L+n+R), make([]float64, L+n+R)
		for j := range outs[r] {
			gouts[r][j] = float64(1000*r+j) + 0.5
			if gi := offs[r] - L + int64(j); gi >= 0 && gi < N {
				outs[r][j] = float64(gi + 1)
			}
		}
	}
	for q, n := range lengths {
		for j := int64(0); j < L+n+R; j++ {
			gi := offs[q] - L + j
			for r, m := range lengths {
				if gi >= offs[r] && gi < offs[r]+m {
					gxs[r][gi-offs[r]] += gouts[q][j]
				}
			}
		}
	}
	return
}

// cachedStep runs one forward and backward on the plan a per-rank cache
// keyed by this rank's own length gives (a deferred plan on a miss), as a
// binding's cache does, and checks them against the whole sequence.
func cachedStep(g *Group, cache map[string]*Plan, key string, lengths []int64, L, R int64) error {
	me := g.Rank()
	xs, outs, gouts, gxs := seqOracle(lengths, L, R)
	n := lengths[me]
	p := cache[key]
	if p == nil {
		var err error
		if p, err = g.NewDeferredPlan([]Spec{{DType: Float64, Shape: []int64{n}, Dim: 0, Left: L, Right: R}}); err != nil {
			return err
		}
		cache[key] = p
	}
	// One element more than needed: PtrOf needs one, even for an empty shard.
	out, gx := make([]float64, L+n+R+1), make([]float64, n+1)
	x, gout := append(xs[me], 0), append(gouts[me], 0)
	if err := p.Do(CallForward, true, PtrOf(x), PtrOf(out), nil); err != nil {
		return err
	}
	if err := p.Do(CallBackward, true, PtrOf(gout), PtrOf(gx), nil); err != nil {
		return err
	}
	out, gx = out[:L+n+R], gx[:n]
	if fmt.Sprint(out) != fmt.Sprint(outs[me]) {
		return fmt.Errorf("lengths %v: rank %d: out %v, want %v", lengths, me, out, outs[me])
	}
	if fmt.Sprint(gx) != fmt.Sprint(gxs[me]) {
		return fmt.Errorf("lengths %v: rank %d: grad_x %v, want %v", lengths, me, gx, gxs[me])
	}
	return nil
}

// Shards change from step to step; a rank whose own length repeats reuses
// its plan while the others make new ones. Before plans carried their
// agreed identity, such a step waited out the deadline.
func TestPlansFollowChangingShards(t *testing.T) {
	steps := map[int][][]int64{
		2: {{3, 3}, {3, 5}, {0, 4}, {3, 1}, {3, 3}, {1, 0}},
		3: {{2, 2, 2}, {2, 0, 3}, {1, 2, 2}, {2, 2, 2}},
		4: {{1, 1, 1, 4}, {0, 2, 1, 3}, {1, 1, 1, 4}, {2, 2, 2, 2}, {0, 0, 5, 1}, {2, 3, 2, 2}},
	}
	for W, seq := range steps {
		for _, h := range [][2]int64{{2, 1}, {1, 0}, {0, 2}} {
			t.Run(fmt.Sprintf("W%d_L%d_R%d", W, h[0], h[1]), func(t *testing.T) {
				begin := time.Now()
				errs := halotest.Groups(W, GroupOptions{Timeout: 5 * time.Second}, func(g *Group) error {
					cache := map[string]*Plan{}
					for _, lengths := range seq {
						if err := cachedStep(g, cache, fmt.Sprint(lengths[g.Rank()]), lengths, h[0], h[1]); err != nil {
							return err
						}
					}
					return nil
				})
				for r, err := range errs {
					if err != nil {
						t.Errorf("rank %d: %v", r, err)
					}
				}
				if d := time.Since(begin); d > 3*time.Second {
					t.Errorf("took %v: a rank waited for a deadline", d)
				}
			})
		}
	}
}

// Within one step: the second layer's input has a new length on rank 0
// only (a down-sampler that prepends frames on the first rank), so the other
// ranks find the first layer's plan for it.
func TestPlansWithinAStep(t *testing.T) {
	for _, W := range []int{2, 3, 4} {
		errs := halotest.Groups(W, GroupOptions{Timeout: 5 * time.Second}, func(g *Group) error {
			cache := map[string]*Plan{}
			a := make([]int64, W)
			for r := range a {
				a[r] = 4
			}
			b := append([]int64{6}, a[1:]...)
			for step := 0; step < 3; step++ {
				for _, lengths := range [][]int64{a, b, a} {
					if err := cachedStep(g, cache, fmt.Sprint(lengths[g.Rank()]), lengths, 2, 1); err != nil {
						return fmt.Errorf("step %d: %w", step, err)
					}
				}
			}
			return nil
		})
		for r, err := range errs {
			if err != nil {
				t.Errorf("W=%d rank %d: %v", W, r, err)
			}
		}
	}
}

// Ranks that truly disagree fail at once, every rank with MISMATCH saying
// what each was doing, and the group stays usable.
func TestDisagreementFailsFastAndAlike(t *testing.T) {
	cases := []struct {
		name string
		call func(g *Group, p *Plan) error
		spec func(rank int) Spec
		want string
	}{
		{"dtype", func(g *Group, p *Plan) error {
			return p.Do(CallForward, true, PtrOf(make([]float64, 4)), PtrOf(make([]float64, 8)), nil)
		},
			func(r int) Spec {
				return Spec{DType: []DType{Float64, Float32}[r], Shape: []int64{4}, Dim: 0, Left: 2, Right: 2}
			}, "dtype: float64 on rank 0, float32 on rank 1"},
		{"direction", func(g *Group, p *Plan) error {
			if g.Rank() == 0 {
				return p.Do(CallForward, true, PtrOf(make([]float64, 4)), PtrOf(make([]float64, 8)), nil)
			}
			return p.Do(CallBackward, true, PtrOf(make([]float64, 8)), PtrOf(make([]float64, 4)), nil)
		}, func(r int) Spec { return Spec{DType: Float64, Shape: []int64{4}, Dim: 0, Left: 2, Right: 2} },
			"call: forward on rank 0, backward on rank 1"},
		// Tensors checked after the agreement (a deferred plan has no
		// layout to check them against before): a NULL on one rank fails
		// the call on both, naming it.
		{"tensors", func(g *Group, p *Plan) error {
			x := PtrOf(make([]float64, 4))
			if g.Rank() == 1 {
				x = nil
			}
			err := p.Do(CallForward, true, x, PtrOf(make([]float64, 8)), nil)
			if !errors.Is(err, ErrInvalid) {
				return fmt.Errorf("got %v, want INVALID", err)
			}
			return fmt.Errorf("%w: %v", ErrMismatch, err) // the case's check reads the message
		}, func(r int) Spec { return Spec{DType: Float64, Shape: []int64{4}, Dim: 0, Left: 2, Right: 2} },
			"rank 1 failed after the ranks agreed, so no rank went on (rank 1: invalid argument: rank 1: forward of plan 1: x is NULL)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			begin := time.Now()
			errs := halotest.Groups(2, GroupOptions{Timeout: 10 * time.Second}, func(g *Group) error {
				p, err := g.NewDeferredPlan([]Spec{c.spec(g.Rank())})
				if err != nil {
					return err
				}
				err = c.call(g, p)
				if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), c.want) {
					return fmt.Errorf("got %v, want MISMATCH naming %q", err, c.want)
				}
				// Still usable: an exchange both agree on runs.
				q, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{2}, Dim: 0, Left: 1, Right: 1})
				if err != nil {
					return fmt.Errorf("after the mismatch: %w", err)
				}
				return q.Do(CallForward, true, PtrOf(make([]float32, 2)), PtrOf(make([]float32, 4)), nil)
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
			if d := time.Since(begin); d > 2*time.Second {
				t.Errorf("took %v", d)
			}
		})
	}
}

// A rank that cannot make its part of a plan after the agreement (here its
// staging cannot be allocated) makes creation fail on every rank, with the
// same class, naming it; the group stays usable.
func TestCreationIsAllOrNothing(t *testing.T) {
	hub := halotest.NewMemHub(2)
	refuse := true                                                  // rank 1's goroutine only
	hub.FailAlloc(1, func(n int) bool { return refuse && n < 256 }) // staging only: the agreement's buffers are larger
	errs := halotest.Ranks(2, func(r int) error {
		g, err := NewGroup(hub.Transport(r), GroupOptions{Timeout: 10 * time.Second})
		if err != nil {
			return err
		}
		// Halos along dim 1 of a row-major (4, 3) are strided: packed
		// through staging.
		_, err = g.NewPlan(Spec{DType: Float32, Shape: []int64{4, 3}, Dim: 1, Left: 1, Right: 1})
		if !errors.Is(err, ErrTransport) || !strings.Contains(err.Error(), "rank 1 failed after the ranks agreed") {
			return fmt.Errorf("got %v, want TRANSPORT naming rank 1", err)
		}
		if r == 1 {
			refuse = false
		}
		q, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{2}, Dim: 0, Left: 1, Right: 1})
		if err != nil {
			return fmt.Errorf("after the failed creation: %w", err)
		}
		return q.Do(CallForward, true, PtrOf(make([]float32, 2)), PtrOf(make([]float32, 4)), nil)
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}
