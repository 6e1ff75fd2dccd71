package benchmark

import (
	"fmt"
	"unsafe"

	"github.com/halo-cp/halo/halo"
)

// collective moves the benchmark's own bookkeeping (iteration counts,
// timings, wrong counts) between ranks with the halo exchange itself: a plan
// over a [1, chunk] float64 tensor with one slice of halo on each side, so
// that every forward hands each rank its neighbours' vectors. A reduction
// walks the chain from the last rank to rank 0, a broadcast from rank 0 to
// the last: W-1 exchanges each, with nothing but the communicator under test.
type collective struct {
	rank, size int
	plan       *halo.Plan
	buf        *cbuf // [left | x | right], chunk float64 each
	chunk      int
}

const collectiveChunk = 8192

func newCollective(c group) (*collective, error) {
	k := &collective{rank: c.Rank(), size: c.Size(), chunk: collectiveChunk}
	if k.size == 1 {
		return k, nil
	}
	shape := []int64{1, int64(k.chunk)}
	plan, err := c.NewPlan(halo.Spec{DType: halo.Float64, Shape: shape, Dim: 0, Left: 1, Right: 1,
		XStrides: halo.ContiguousStrides([]int64{3, int64(k.chunk)})})
	if err != nil {
		return nil, fmt.Errorf("creating the plan that gathers results: %w", err)
	}
	buf, err := allocC(int64(3 * k.chunk * 8))
	if err != nil {
		plan.Close()
		return nil, err
	}
	k.plan, k.buf = plan, buf
	return k, nil
}

func (k *collective) close() {
	if k.plan != nil {
		k.plan.Close()
	}
	k.buf.free()
}

func (k *collective) part(i int) []float64 {
	return unsafe.Slice((*float64)(k.buf.at(int64(i*k.chunk*8))), k.chunk)
}

// reduce combines every rank's v element by element into rank 0's v; the
// other ranks' v are left in an unspecified state.
func (k *collective) reduce(v []float64, combine func(a, b float64) float64) error {
	if k.size == 1 {
		return nil
	}
	x, right := k.part(1), k.part(2)
	for lo := 0; lo < len(v); lo += k.chunk {
		n := copy(x, v[lo:])
		for s := k.size - 2; s >= 0; s-- {
			if err := k.plan.Do(halo.CallForward, true, k.buf.at(int64(k.chunk*8)), k.buf.p, nil); err != nil {
				return fmt.Errorf("gathering results: %w", err)
			}
			if k.rank == s {
				for i := 0; i < n; i++ {
					x[i] = combine(x[i], right[i])
				}
			}
		}
		copy(v[lo:lo+n], x[:n])
	}
	return nil
}

// broadcast copies rank 0's v to every rank.
func (k *collective) broadcast(v []float64) error {
	if k.size == 1 {
		return nil
	}
	left, x := k.part(0), k.part(1)
	for lo := 0; lo < len(v); lo += k.chunk {
		n := copy(x, v[lo:])
		for s := 1; s < k.size; s++ {
			if err := k.plan.Do(halo.CallForward, true, k.buf.at(int64(k.chunk*8)), k.buf.p, nil); err != nil {
				return fmt.Errorf("sharing results: %w", err)
			}
			if k.rank == s {
				copy(x[:n], left[:n])
			}
		}
		copy(v[lo:lo+n], x[:n])
	}
	return nil
}

// allreduce leaves the combination of every rank's v on every rank.
func (k *collective) allreduce(v []float64, combine func(a, b float64) float64) error {
	if err := k.reduce(v, combine); err != nil {
		return err
	}
	return k.broadcast(v)
}

func maxf(a, b float64) float64 { return max(a, b) }
func sumf(a, b float64) float64 { return a + b }
