package halo_test

import (
	"errors"
	"fmt"
	"math/rand"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	. "github.com/halo-cp/halo/halo"
	"github.com/halo-cp/halo/halo/halotest"
)

type caseSpec struct {
	W       int
	dtype   DType
	shape   []int64 // with dim's entry ignored
	lengths []int64
	dim     int
	L, R    int64
	inPlace bool // x inside out, grad_x inside grad_out
	strided bool
	halos   bool // a halos-only plan: left and right tensors, grad_x added to
	async   bool // Start, then Test until done or Wait
	padding Padding
	order   []int // every tensor dense in this dim order, outermost first (channels-last and the like), if set
}

func (c caseSpec) String() string {
	return fmt.Sprintf("W=%d %v shape=%v dim=%d lengths=%v L=%d R=%d inplace=%v strided=%v halos=%v async=%v padding=%v",
		c.W, c.dtype, c.shape, c.dim, c.lengths, c.L, c.R, c.inPlace, c.strided, c.halos, c.async, c.padding)
}

// sliceAlong is slices [lo, hi) of t along dim.
func sliceAlong(t Logical, dim int, lo, hi int64) Logical {
	sh := append([]int64(nil), t.Shape...)
	sh[dim] = hi - lo
	out := Logical{Shape: sh, Bits: make([]uint64, 0, Numel(sh))}
	idx := make([]int64, len(t.Shape))
	for i := range t.Bits {
		Unravel(t.Shape, int64(i), idx)
		if idx[dim] >= lo && idx[dim] < hi {
			out.Bits = append(out.Bits, t.Bits[i])
		}
	}
	return out
}

// exchange runs one direction blocking, or asynchronously: Start, a few
// Tests (each may finish it), then Wait if it is still in flight.
func exchange(p *Plan, c caseSpec, rng *rand.Rand, d Direction, blocking, start func() error) error {
	if !c.async {
		return blocking()
	}
	if err := start(); err != nil {
		return err
	}
	for i := rng.Intn(4); i > 0; i-- {
		done, err := p.Test(d)
		if err != nil || done {
			return err
		}
		runtime.Gosched()
	}
	return p.Wait(d)
}

// checkCase runs forward and backward on every rank and compares each
// output bit for bit with the oracle.
func checkCase(t *testing.T, rng *rand.Rand, c caseSpec, opts GroupOptions) {
	t.Helper()
	elem := c.dtype.Size()
	xs := make([]Logical, c.W)
	grads := make([]Logical, c.W)
	specs := make([]Spec, c.W)
	for r := 0; r < c.W; r++ {
		sh := append([]int64(nil), c.shape...)
		sh[c.dim] = c.lengths[r]
		xs[r] = Logical{Shape: sh, Bits: make([]uint64, Numel(sh))}
		for i := range xs[r].Bits {
			xs[r].Bits[i] = RandomValue(rng, c.dtype)
		}
		osh := append([]int64(nil), sh...)
		osh[c.dim] += c.L + c.R
		grads[r] = Logical{Shape: osh, Bits: make([]uint64, Numel(osh))}
		for i := range grads[r].Bits {
			grads[r].Bits[i] = RandomValue(rng, c.dtype)
		}
		s := Spec{DType: c.dtype, Shape: sh, Dim: c.dim, Left: c.L, Right: c.R, HalosOnly: c.halos, Padding: c.padding}
		if c.strided {
			s.OutStrides = RandomStrides(rng, osh)
			s.GradOutStrides = RandomStrides(rng, osh)
			s.XStrides = RandomStrides(rng, sh)
			s.GradXStrides = RandomStrides(rng, sh)
		}
		if c.order != nil {
			s.OutStrides, s.GradOutStrides = StridesInOrder(osh, c.order), StridesInOrder(osh, c.order)
			s.XStrides, s.GradXStrides = StridesInOrder(sh, c.order), StridesInOrder(sh, c.order)
		}
		if c.halos {
			s.OutStrides, s.GradOutStrides = nil, nil
			if c.strided {
				lsh, rsh := append([]int64(nil), sh...), append([]int64(nil), sh...)
				lsh[c.dim], rsh[c.dim] = c.L, c.R
				s.LeftStrides, s.GradLeftStrides = RandomStrides(rng, lsh), RandomStrides(rng, lsh)
				s.RightStrides, s.GradRightStrides = RandomStrides(rng, rsh), RandomStrides(rng, rsh)
			}
			if c.order != nil {
				lsh, rsh := append([]int64(nil), sh...), append([]int64(nil), sh...)
				lsh[c.dim], rsh[c.dim] = c.L, c.R
				s.LeftStrides, s.GradLeftStrides = StridesInOrder(lsh, c.order), StridesInOrder(lsh, c.order)
				s.RightStrides, s.GradRightStrides = StridesInOrder(rsh, c.order), StridesInOrder(rsh, c.order)
			}
		} else if c.inPlace {
			if s.OutStrides == nil {
				s.OutStrides = ContiguousStrides(osh)
			}
			s.XStrides = s.OutStrides
			s.GradOutStrides = s.OutStrides
			s.GradXStrides = s.OutStrides
		}
		specs[r] = s.Normalized()
	}
	wantOut, wantGX := OraclePadding(c.dtype, xs, grads, c.dim, c.L, c.R, c.padding)
	var mu sync.Mutex
	var failures []string
	errs := halotest.Groups(c.W, opts, func(g *Group) error {
		r := g.Rank()
		s := specs[r]
		p, err := g.NewPlan(s)
		if err != nil {
			return err
		}
		defer p.Close()
		osh := s.OutShape()
		rng := rand.New(rand.NewSource(int64(r)))
		if c.halos {
			return checkHalos(p, c, rng, xs[r], grads[r], wantOut[r], wantGX[r], func(f string) {
				mu.Lock()
				defer mu.Unlock()
				failures = append(failures, fmt.Sprintf("rank %d %s", r, f))
			})
		}
		out := NewMemory(osh, s.OutStrides, elem, 64)
		gout := NewMemory(osh, s.GradOutStrides, elem, 64)
		out.Fill(0xA5) // garbage where the plan must write
		var x, gx *Memory
		if c.inPlace {
			x = out.View(c.L*s.OutStrides[c.dim], s.XStrides)
			x.Store(xs[r])
		} else {
			x = NewMemory(s.Shape, s.XStrides, elem, 64)
			x.Store(xs[r])
		}
		if err := exchange(p, c, rng, DirForward, func() error { return p.Do(CallForward, true, x.Ptr(), out.Ptr(), nil) },
			func() error { return p.Do(CallForward, false, x.Ptr(), out.Ptr(), nil) }); err != nil {
			return err
		}
		gout.Store(grads[r])
		if c.inPlace {
			gx = gout.View(c.L*s.GradOutStrides[c.dim], s.GradXStrides)
		} else {
			gx = NewMemory(s.Shape, s.GradXStrides, elem, 64)
			gx.Fill(0xA5)
		}
		if err := exchange(p, c, rng, DirBackward, func() error { return p.Do(CallBackward, true, gout.Ptr(), gx.Ptr(), nil) },
			func() error { return p.Do(CallBackward, false, gout.Ptr(), gx.Ptr(), nil) }); err != nil {
			return err
		}
		gotOut, gotGX := out.Load(osh), gx.Load(s.Shape)
		mu.Lock()
		defer mu.Unlock()
		for i, v := range wantOut[r].Bits {
			if gotOut.Bits[i] != v {
				failures = append(failures, fmt.Sprintf("rank %d out[%d] = %#x, want %#x", r, i, gotOut.Bits[i], v))
				break
			}
		}
		for i, v := range wantGX[r].Bits {
			if gotGX.Bits[i] != v {
				failures = append(failures, fmt.Sprintf("rank %d grad_x[%d] = %#x, want %#x", r, i, gotGX.Bits[i], v))
				break
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", c, r, err)
		}
	}
	if len(failures) > 0 {
		t.Fatalf("%v:\n%s", c, strings.Join(failures, "\n"))
	}
}

// checkHalos runs a halos-only plan: the halos must equal the padded
// oracle's halo slices, and grad_x, filled with grad_out's interior before
// the backward, must end as the oracle's grad_x, bit for bit.
func checkHalos(p *Plan, c caseSpec, rng *rand.Rand, x, grad, wantOut, wantGX Logical, fail func(string)) error {
	s := p.Spec()
	elem := c.dtype.Size()
	n := s.Shape[c.dim]
	lsh, rsh := append([]int64(nil), s.Shape...), append([]int64(nil), s.Shape...)
	lsh[c.dim], rsh[c.dim] = c.L, c.R
	xm := NewMemory(s.Shape, s.XStrides, elem, 64)
	xm.Store(x)
	left, right := NewMemory(lsh, s.LeftStrides, elem, 64), NewMemory(rsh, s.RightStrides, elem, 64)
	left.Fill(0xA5)
	right.Fill(0xA5)
	if err := exchange(p, c, rng, DirForward, func() error { return p.Do(CallHalosForward, true, xm.Ptr(), left.Ptr(), right.Ptr()) },
		func() error { return p.Do(CallHalosForward, false, xm.Ptr(), left.Ptr(), right.Ptr()) }); err != nil {
		return err
	}
	gl, gr := NewMemory(lsh, s.GradLeftStrides, elem, 64), NewMemory(rsh, s.GradRightStrides, elem, 64)
	gl.Store(sliceAlong(grad, c.dim, 0, c.L))
	gr.Store(sliceAlong(grad, c.dim, c.L+n, c.L+n+c.R))
	gx := NewMemory(s.Shape, s.GradXStrides, elem, 64)
	gx.Store(sliceAlong(grad, c.dim, c.L, c.L+n))
	if err := exchange(p, c, rng, DirBackward, func() error { return p.Do(CallHalosBackward, true, gl.Ptr(), gr.Ptr(), gx.Ptr()) },
		func() error { return p.Do(CallHalosBackward, false, gl.Ptr(), gr.Ptr(), gx.Ptr()) }); err != nil {
		return err
	}
	for _, cmp := range []struct {
		name      string
		got, want Logical
	}{
		{"left", left.Load(lsh), sliceAlong(wantOut, c.dim, 0, c.L)},
		{"right", right.Load(rsh), sliceAlong(wantOut, c.dim, c.L+n, c.L+n+c.R)},
		{"grad_x", gx.Load(s.Shape), wantGX},
	} {
		for i, v := range cmp.want.Bits {
			if cmp.got.Bits[i] != v {
				fail(fmt.Sprintf("%s[%d] = %#x, want %#x", cmp.name, i, cmp.got.Bits[i], v))
				break
			}
		}
	}
	return nil
}

func randomCase(rng *rand.Rand) caseSpec {
	c := caseSpec{W: 1 + rng.Intn(5), dtype: DType(rng.Intn(4))}
	nd := 1 + rng.Intn(5)
	c.shape = make([]int64, nd)
	for i := range c.shape {
		c.shape[i] = int64(1 + rng.Intn(4))
	}
	c.dim = rng.Intn(nd)
	c.lengths = make([]int64, c.W)
	for r := range c.lengths {
		c.lengths[r] = int64(rng.Intn(5))
	}
	c.L, c.R = int64(rng.Intn(7)), int64(rng.Intn(7))
	c.inPlace = rng.Intn(4) == 0
	c.strided = rng.Intn(2) == 0
	c.halos = rng.Intn(3) == 0
	c.async = rng.Intn(3) == 0
	return c
}

func TestForwardBackwardRandom(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	n := 400
	if testing.Short() {
		n = 60
	}
	for i := 0; i < n; i++ {
		c := randomCase(rng)
		opts := GroupOptions{Timeout: 10 * time.Second, Transfer: Transfer(rng.Intn(3)), IOVMinSegment: int64(1 + rng.Intn(64))}
		checkCase(t, rng, c, opts)
	}
}

func TestReferenceCases(t *testing.T) {
	rng := rand.New(rand.NewSource(2))
	for _, c := range []caseSpec{
		{W: 2, dtype: Float32, shape: []int64{2, 3, 8, 4}, lengths: []int64{8, 8}, dim: 2, L: 2, R: 0},
		{W: 4, dtype: BFloat16, shape: []int64{1, 3, 5, 4, 4}, lengths: []int64{5, 5, 5, 5}, dim: 2, L: 1, R: 1},
		{W: 3, dtype: Float16, shape: []int64{4, 6, 2}, lengths: []int64{6, 6, 6}, dim: 1, L: 2, R: 2},
		{W: 3, dtype: Float64, shape: []int64{3, 1, 2}, lengths: []int64{1, 1, 1}, dim: 1, L: 3, R: 3}, // multi-hop
		{W: 4, dtype: Float32, shape: []int64{3, 2}, lengths: []int64{0, 3, 1, 0}, dim: 0, L: 2, R: 2}, // empty shards
		{W: 1, dtype: Float32, shape: []int64{2, 5}, lengths: []int64{5}, dim: 1, L: 2, R: 1},
		{W: 2, dtype: Float32, shape: []int64{2, 5}, lengths: []int64{5, 5}, dim: 1, L: 0, R: 0},
		{W: 3, dtype: Float32, shape: []int64{4, 0, 3}, lengths: []int64{3, 3, 3}, dim: 2, L: 1, R: 1}, // empty tensor
	} {
		for _, inPlace := range []bool{false, true} {
			for _, strided := range []bool{false, true} {
				c.inPlace, c.strided = inPlace, strided
				checkCase(t, rng, c, GroupOptions{Timeout: 10 * time.Second})
			}
		}
	}
}

func TestMismatchFailsEverywhere(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(r int, s *Spec)
		want string
	}{
		{"dtype", func(r int, s *Spec) {
			if r == 2 {
				s.DType = Float16
			}
		}, "dtype: float32 on ranks 0-1, float16 on rank 2"},
		{"shape", func(r int, s *Spec) {
			if r == 1 {
				s.Shape[0] = 7
			}
		}, "shape[0]: 4 on ranks 0, 2, 7 on rank 1"},
		{"halo", func(r int, s *Spec) { s.Left = int64(r) }, "left halo: 0 on rank 0, 1 on rank 1, 2 on rank 2"},
		{"dim", func(r int, s *Spec) {
			if r == 0 {
				s.Dim = 0
			}
		}, "dim: 0 on rank 0, 1 on ranks 1-2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := halotest.Groups(3, GroupOptions{Timeout: 5 * time.Second}, func(g *Group) error {
				s := Spec{DType: Float32, Shape: []int64{4, 5}, Dim: 1, Left: 1, Right: 1}
				tc.edit(g.Rank(), &s)
				p, err := g.NewPlan(s)
				if err == nil {
					p.Close()
				}
				return err
			})
			for r, err := range errs {
				if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("rank %d: got %v, want ErrMismatch containing %q", r, err, tc.want)
				}
			}
		})
	}
}

func TestMissingRankTimesOut(t *testing.T) {
	start := time.Now()
	errs := halotest.Groups(3, GroupOptions{Timeout: 300 * time.Millisecond}, func(g *Group) error {
		if g.Rank() == 1 {
			return nil // never creates the plan
		}
		_, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{2, 2}, Dim: 0, Left: 1, Right: 1})
		if err == nil {
			return errors.New("plan creation succeeded without rank 1")
		}
		if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "rank 1") {
			return fmt.Errorf("want a timeout that names rank 1, got %v", err)
		}
		// The group is unusable now, and says why.
		_, err2 := g.NewPlan(Spec{DType: Float32, Shape: []int64{2, 2}, Dim: 0})
		if !errors.Is(err2, ErrFailed) {
			return fmt.Errorf("second plan after failure: %v", err2)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v for a 300ms deadline", d)
	}
}

func TestPeerFailureDuringForward(t *testing.T) {
	hub := halotest.NewMemHub(2)
	g0, _ := NewGroup(hub.Transport(0), GroupOptions{Timeout: 5 * time.Second})
	g1, _ := NewGroup(hub.Transport(1), GroupOptions{Timeout: 5 * time.Second})
	spec := Spec{DType: Float32, Shape: []int64{4}, Dim: 0, Left: 1, Right: 1}
	var p1 *Plan
	done := make(chan error)
	go func() {
		var err error
		p1, err = g1.NewPlan(spec)
		done <- err
	}()
	p0, err := g0.NewPlan(spec)
	if err != nil || <-done != nil {
		t.Fatal(err)
	}
	defer p1.Close()
	hub.Kill(1)
	x, out := make([]float32, 4), make([]float32, 6)
	err = p0.Do(CallForward, true, PtrOf(x), PtrOf(out), nil)
	if !errors.Is(err, ErrPeerFailed) || !strings.Contains(err.Error(), "rank 1") || !strings.Contains(err.Error(), "rank 0: forward of plan 1") {
		t.Fatalf("got %v", err)
	}
	if err := p0.Do(CallForward, true, PtrOf(x), PtrOf(out), nil); !errors.Is(err, ErrFailed) {
		t.Fatalf("forward after a failure: got %v, want ErrFailed", err)
	}
	if err := p0.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestInvalidSpecs(t *testing.T) {
	g := halotest.Group(GroupOptions{})
	for _, tc := range []struct {
		spec Spec
		want string
	}{
		{Spec{DType: Float32}, "ndim 0 is out of range"},
		{Spec{DType: Float32, Shape: make([]int64, 9)}, "ndim 9 is out of range"},
		{Spec{DType: 9, Shape: []int64{2}}, "unknown dtype 9"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, Dim: 2}, "dim 2 is out of range for a 2-d tensor"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, Dim: -1}, "dim -1 is out of range"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, Left: -1}, "must not be negative (left -1, right 0)"},
		{Spec{DType: Float32, Shape: []int64{2, -3}}, "shape[1] = -3 is negative"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, Padding: 5}, "unknown padding 5"},
		{Spec{DType: Float32, Shape: []int64{1 << 40, 1 << 40}, Dim: 1}, "overflows"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, XStrides: []int64{1}}, "x has 1 strides for 2 dims"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, OutStrides: []int64{1, 1}, Left: 1}, "out of shape [3 3]: strides [1 1] overlap"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, GradXStrides: []int64{-3, 1}}, "grad_x of shape [2 3]: stride[0] = -3 is negative"},
		{Spec{DType: Float32, Shape: []int64{2, 3}, Left: 1 << 50}, "too large"},
	} {
		_, err := g.NewPlan(tc.spec)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "rank 0") {
			t.Errorf("%+v: got %v, want ErrInvalid with %q", tc.spec, err, tc.want)
		}
	}
	// Broadcast (stride 0) inputs are fine to read.
	if _, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{2, 3}, XStrides: []int64{0, 1}, Left: 1}); err != nil {
		t.Errorf("stride-0 x refused: %v", err)
	}
}

func TestBadPointers(t *testing.T) {
	g := halotest.Group(GroupOptions{})
	p, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{4, 3}, Dim: 0, Left: 1, Right: 1})
	if err != nil {
		t.Fatal(err)
	}
	out := make([]float32, 18)
	x := make([]float32, 12)
	check := func(err error, want string) {
		t.Helper()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v, want %q", err, want)
		}
	}
	check(p.Do(CallForward, true, nil, PtrOf(out), nil), "x is NULL")
	check(p.Do(CallForward, true, PtrOf(x), nil, nil), "out is NULL")
	check(p.Do(CallBackward, true, nil, PtrOf(x), nil), "grad_out is NULL")
	check(p.Do(CallForward, true, PtrOf(out[1:]), PtrOf(out), nil), "x overlaps out but is not its interior")
	if err := p.Do(CallForward, true, PtrOf(out[3:]), PtrOf(out), nil); err != nil { // exactly the interior
		t.Errorf("in-place forward: %v", err)
	}
	p.Close()
	p.Close()
	if err := p.Do(CallForward, true, PtrOf(x), PtrOf(out), nil); !errors.Is(err, ErrClosed) {
		t.Errorf("forward after close: %v", err)
	}
}

func TestConcurrentPlansKeepApart(t *testing.T) {
	// Two plans with identical layouts: their messages must never mix, even
	// when ranks run them in different orders.
	errs := halotest.Groups(2, GroupOptions{Timeout: 5 * time.Second}, func(g *Group) error {
		s := Spec{DType: Float32, Shape: []int64{4}, Dim: 0, Left: 2, Right: 2}
		a, err := g.NewPlan(s)
		if err != nil {
			return err
		}
		b, err := g.NewPlan(s)
		if err != nil {
			return err
		}
		r := float32(g.Rank())
		xa, xb := []float32{r, r, r, r}, []float32{10 + r, 10 + r, 10 + r, 10 + r}
		oa, ob := make([]float32, 8), make([]float32, 8)
		if err := a.Do(CallForward, true, PtrOf(xa), PtrOf(oa), nil); err != nil {
			return err
		}
		if err := b.Do(CallForward, true, PtrOf(xb), PtrOf(ob), nil); err != nil {
			return err
		}
		peer := 1 - r
		want := func(o []float32, v float32) error {
			halo := o[6:]
			if g.Rank() == 1 {
				halo = o[:2]
			}
			if halo[0] != v || halo[1] != v {
				return fmt.Errorf("rank %d got halo %v, want %v", g.Rank(), halo, v)
			}
			return nil
		}
		if err := want(oa, peer); err != nil {
			return err
		}
		return want(ob, 10+peer)
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// A forward whose interior copy is large enough to bypass the cache still
// copies every byte to the right place.
func TestLargeInteriorCopy(t *testing.T) {
	g := halotest.Group(GroupOptions{})
	const rows, cols = 3, 1<<19 + 3 // 6 MiB of float32, odd row length
	p, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{rows, cols}, Dim: 1, Left: 1, Right: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	x := make([]float32, rows*cols)
	for i := range x {
		x[i] = float32(i)
	}
	out := make([]float32, rows*(cols+3))
	if err := p.Do(CallForward, true, PtrOf(x), PtrOf(out), nil); err != nil {
		t.Fatal(err)
	}
	for r := 0; r < rows; r++ {
		row := out[r*(cols+3) : (r+1)*(cols+3)]
		if row[0] != 0 || row[cols+1] != 0 || row[cols+2] != 0 {
			t.Fatalf("row %d: padding not zero", r)
		}
		for c := 0; c < cols; c++ {
			if row[1+c] != x[r*cols+c] {
				t.Fatalf("row %d col %d: %v, want %v", r, c, row[1+c], x[r*cols+c])
			}
		}
	}
}

// A plan over several layouts exchanges each exactly as a plan of its own
// would, with fewer messages: one per peer and kind.
func TestMultiLayout(t *testing.T) {
	rng := rand.New(rand.NewSource(7))
	n := 60
	if testing.Short() {
		n = 15
	}
	for i := 0; i < n; i++ {
		W, K := 1+rng.Intn(4), 1+rng.Intn(4)
		halos, async := rng.Intn(2) == 0, rng.Intn(3) == 0
		cases := make([]caseSpec, K)
		for k := range cases {
			c := randomCase(rng)
			c.W, c.halos, c.async, c.inPlace = W, halos, async, false
			c.lengths = make([]int64, W)
			for r := range c.lengths {
				c.lengths[r] = int64(rng.Intn(5))
			}
			cases[k] = c
		}
		checkMulti(t, rng, cases)
	}
}

func checkMulti(t *testing.T, rng *rand.Rand, cases []caseSpec) {
	t.Helper()
	W, K := cases[0].W, len(cases)
	type layoutData struct {
		xs, grads, wantOut, wantGX []Logical
		specs                      []Spec
	}
	data := make([]layoutData, K)
	for k, c := range cases {
		d := &data[k]
		for r := 0; r < W; r++ {
			sh := append([]int64(nil), c.shape...)
			sh[c.dim] = c.lengths[r]
			osh := append([]int64(nil), sh...)
			osh[c.dim] += c.L + c.R
			x, g := Logical{Shape: sh, Bits: make([]uint64, Numel(sh))}, Logical{Shape: osh, Bits: make([]uint64, Numel(osh))}
			for i := range x.Bits {
				x.Bits[i] = RandomValue(rng, c.dtype)
			}
			for i := range g.Bits {
				g.Bits[i] = RandomValue(rng, c.dtype)
			}
			d.xs, d.grads = append(d.xs, x), append(d.grads, g)
			s := Spec{DType: c.dtype, Shape: sh, Dim: c.dim, Left: c.L, Right: c.R, HalosOnly: c.halos, Padding: c.padding}
			if c.strided && !c.halos {
				s.XStrides, s.OutStrides = RandomStrides(rng, sh), RandomStrides(rng, osh)
			}
			d.specs = append(d.specs, s.Normalized())
		}
		d.wantOut, d.wantGX = OraclePadding(c.dtype, d.xs, d.grads, c.dim, c.L, c.R, c.padding)
	}
	var mu sync.Mutex
	var failures []string
	errs := halotest.Groups(W, GroupOptions{Timeout: 10 * time.Second}, func(g *Group) error {
		r := g.Rank()
		specs := make([]Spec, K)
		for k := range specs {
			specs[k] = data[k].specs[r]
		}
		p, err := g.NewMultiPlan(specs)
		if err != nil {
			return err
		}
		defer p.Close()
		single := 0
		for k := range specs { // the same layouts one plan each, for the message count
			q, err := g.NewPlan(specs[k])
			if err != nil {
				return err
			}
			single += q.Messages(DirForward)
			q.Close()
		}
		if m := p.Messages(DirForward); m > single || m > 2*(W-1) {
			return fmt.Errorf("%d forward messages for %d layouts of %d ranks (%d with a plan each)", m, K, W, single)
		}
		halos := cases[0].halos
		elem := func(k int) int { return cases[k].dtype.Size() }
		a, b, c := make([]unsafe.Pointer, K), make([]unsafe.Pointer, K), make([]unsafe.Pointer, K)
		mems := make([][3]*Memory, K)
		for k := range specs {
			s, cs := specs[k], cases[k]
			xm := NewMemory(s.Shape, s.XStrides, elem(k), 64)
			xm.Store(data[k].xs[r])
			if halos {
				lsh, rsh := append([]int64(nil), s.Shape...), append([]int64(nil), s.Shape...)
				lsh[cs.dim], rsh[cs.dim] = cs.L, cs.R
				mems[k] = [3]*Memory{xm, NewMemory(lsh, s.LeftStrides, elem(k), 64), NewMemory(rsh, s.RightStrides, elem(k), 64)}
			} else {
				mems[k] = [3]*Memory{xm, NewMemory(s.OutShape(), s.OutStrides, elem(k), 64)}
			}
			for _, m := range mems[k][1:] {
				if m != nil {
					m.Fill(0xA5)
				}
			}
			a[k], b[k] = mems[k][0].Ptr(), mems[k][1].Ptr()
			if halos {
				c[k] = mems[k][2].Ptr()
			}
		}
		var fwd func() error
		switch {
		case halos && cases[0].async:
			fwd = func() error {
				if err := p.DoMulti(CallHalosForward, false, a, b, c); err != nil {
					return err
				}
				return p.Wait(DirForward)
			}
		case halos:
			fwd = func() error { return p.DoMulti(CallHalosForward, true, a, b, c) }
		case cases[0].async:
			fwd = func() error {
				if err := p.DoMulti(CallForward, false, a, b, nil); err != nil {
					return err
				}
				return p.Wait(DirForward)
			}
		default:
			fwd = func() error { return p.DoMulti(CallForward, true, a, b, nil) }
		}
		if err := fwd(); err != nil {
			return err
		}
		// Backward: grad_out (or the halo gradients, with grad_x holding the
		// interior) per layout.
		for k := range specs {
			s, cs := specs[k], cases[k]
			n := s.Shape[cs.dim]
			gx := NewMemory(s.Shape, s.GradXStrides, elem(k), 64)
			if halos {
				gl := NewMemory(mems[k][1].Shape(), s.GradLeftStrides, elem(k), 64)
				gr := NewMemory(mems[k][2].Shape(), s.GradRightStrides, elem(k), 64)
				gl.Store(sliceAlong(data[k].grads[r], cs.dim, 0, cs.L))
				gr.Store(sliceAlong(data[k].grads[r], cs.dim, cs.L+n, cs.L+n+cs.R))
				gx.Store(sliceAlong(data[k].grads[r], cs.dim, cs.L, cs.L+n))
				a[k], b[k], c[k] = gl.Ptr(), gr.Ptr(), gx.Ptr()
			} else {
				gout := NewMemory(s.OutShape(), s.GradOutStrides, elem(k), 64)
				gout.Store(data[k].grads[r])
				a[k], b[k] = gout.Ptr(), gx.Ptr()
			}
			defer func(k int, gx *Memory) { // checked after the backward below
				mu.Lock()
				defer mu.Unlock()
				got := gx.Load(specs[k].Shape)
				for i, v := range data[k].wantGX[r].Bits {
					if got.Bits[i] != v {
						failures = append(failures, fmt.Sprintf("rank %d layout %d grad_x[%d] = %#x, want %#x", r, k, i, got.Bits[i], v))
						break
					}
				}
			}(k, gx)
		}
		var err2 error
		if halos {
			err2 = p.DoMulti(CallHalosBackward, true, a, b, c)
		} else {
			err2 = p.DoMulti(CallBackward, true, a, b, nil)
		}
		if err2 != nil {
			return err2
		}
		mu.Lock()
		defer mu.Unlock()
		for k := range specs {
			cs, n := cases[k], specs[k].Shape[cases[k].dim]
			want := data[k].wantOut[r]
			if !halos {
				got := mems[k][1].Load(specs[k].OutShape())
				for i, v := range want.Bits {
					if got.Bits[i] != v {
						failures = append(failures, fmt.Sprintf("rank %d layout %d out[%d] = %#x, want %#x", r, k, i, got.Bits[i], v))
						break
					}
				}
				continue
			}
			for j, side := range []Logical{sliceAlong(want, cs.dim, 0, cs.L), sliceAlong(want, cs.dim, cs.L+n, cs.L+n+cs.R)} {
				got := mems[k][1+j].Load(side.Shape)
				for i, v := range side.Bits {
					if got.Bits[i] != v {
						failures = append(failures, fmt.Sprintf("rank %d layout %d halo side %d [%d] = %#x, want %#x", r, k, j, i, got.Bits[i], v))
						break
					}
				}
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Fatalf("%v: rank %d: %v", cases, r, err)
		}
	}
	if len(failures) > 0 {
		t.Fatalf("%v:\n%s", cases, strings.Join(failures, "\n"))
	}
}
