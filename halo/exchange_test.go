package halo

import (
	"errors"
	"slices"
	"testing"

	"github.com/halo-cp/halo/halo/transport"
)

// solo is the transport of a group of one rank, which sends nothing.
type solo struct{}

func (solo) Rank() int { return 0 }
func (solo) Size() int { return 1 }
func (solo) Prepare(ops []transport.Op) (transport.Batch, error) {
	return nil, errors.New("a group of one prepares no messages")
}
func (solo) Alloc(n int) (transport.Buffer, error) {
	return nil, errors.New("a group of one allocates no staging")
}

// Start and Wait bracket one exchange per direction: a second start, or a
// wait with nothing started, is a state error that leaves the plan usable.
func TestStartFinishOrder(t *testing.T) {
	g, err := NewGroup(solo{}, GroupOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{3}, Dim: 0, Left: 1, Right: 1})
	if err != nil {
		t.Fatal(err)
	}
	x, out := []float32{1, 2, 3}, make([]float32, 5)
	if err := p.Wait(DirForward); !errors.Is(err, ErrState) {
		t.Fatalf("wait without start: %v", err)
	}
	if err := p.Do(CallForward, false, PtrOf(x), PtrOf(out), nil); err != nil {
		t.Fatal(err)
	}
	if err := p.Do(CallForward, false, PtrOf(x), PtrOf(out), nil); !errors.Is(err, ErrState) {
		t.Fatalf("second start: %v", err)
	}
	// The other direction is independent.
	gx := make([]float32, 3)
	if err := p.Do(CallBackward, true, PtrOf(out), PtrOf(gx), nil); err != nil {
		t.Fatalf("backward while a forward is in flight: %v", err)
	}
	if err := p.Wait(DirForward); err != nil {
		t.Fatal(err)
	}
	if want := []float32{0, 1, 2, 3, 0}; !slices.Equal(out, want) {
		t.Fatalf("out %v, want %v", out, want)
	}
	if err := p.Do(CallForward, true, PtrOf(x), PtrOf(out), nil); err != nil || g.Err() != nil {
		t.Fatalf("forward after the misuse: %v (group: %v)", err, g.Err())
	}
}

// The Go side of a blocking 2 KiB forward, with no wire (a group of one):
// what the algorithm adds to every call besides the transport's and the
// zero fill's cost.
func BenchmarkCallOverhead2KiB(b *testing.B) {
	g, _ := NewGroup(solo{}, GroupOptions{})
	p, err := g.NewPlan(Spec{DType: Float32, Shape: []int64{1, 512}, Dim: 0, Left: 1, Right: 1})
	if err != nil {
		b.Fatal(err)
	}
	out := make([]float32, 3*512)
	x := out[512:1024] // in place
	for b.Loop() {
		if err := p.Do(CallForward, true, PtrOf(x), PtrOf(out), nil); err != nil {
			b.Fatal(err)
		}
	}
}
