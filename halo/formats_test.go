package halo_test

import (
	"math/rand"
	"testing"
	"time"

	. "github.com/halo-cp/halo/halo"
)

// StridesInOrder lays shape out densely with its dims in memory in order,
// outermost first (channels-last is N, H, W, C).
func StridesInOrder(shape []int64, order []int) []int64 {
	st := make([]int64, len(shape))
	acc := int64(1)
	for i := len(order) - 1; i >= 0; i-- {
		st[order[i]] = acc
		acc *= max(shape[order[i]], 1)
	}
	return st
}

// Every tensor of a case dense in one random dim order, as channels-last
// tensors are: the local copies, fills and additions then walk long runs
// across several dims, in memory order, while the wire keeps logical order
// (packed, unpacked, sent as an I/O vector, added). Padded, in place,
// halos-only, zeros, replicate and reflect padding, every dtype, 1 to 4 ranks, halos longer
// than shards: bit for bit against the oracle.
func TestDenseOrdersRandom(t *testing.T) {
	rng := rand.New(rand.NewSource(20))
	n := 160
	if testing.Short() {
		n = 40
	}
	for i := 0; i < n; i++ {
		c := caseSpec{W: 1 + i%4, dtype: DType(rng.Intn(4))}
		nd := 2 + rng.Intn(4)
		c.shape = make([]int64, nd)
		for d := range c.shape {
			c.shape[d] = int64(1 + rng.Intn(4))
			if rng.Intn(3) == 0 {
				c.shape[d] = int64(5 + rng.Intn(12)) // runs past the word loops
			}
		}
		c.dim = rng.Intn(nd)
		c.lengths = make([]int64, c.W)
		for r := range c.lengths {
			c.lengths[r] = int64(rng.Intn(5))
		}
		c.L, c.R = int64(rng.Intn(5)), int64(rng.Intn(5))
		c.order = rng.Perm(nd)
		c.inPlace = rng.Intn(4) == 0
		c.halos = !c.inPlace && rng.Intn(3) == 0
		c.async = rng.Intn(3) == 0
		if rng.Intn(2) == 0 {
			c.padding = []Padding{PadReplicate, PadReflect, PadCircular}[rng.Intn(3)]
			fitPadding(&c)
		}
		opts := GroupOptions{Timeout: 10 * time.Second, Transfer: Transfer(rng.Intn(3)), IOVMinSegment: int64(1 + rng.Intn(64))}
		checkCase(t, rng, c, opts)
	}
}
