package halo

import (
	"fmt"
	"unsafe"
)

// bytesOnly is the executor of a plan over memory that the CPU must not
// touch (CUDA): the wire writes every slab where it belongs, straight from
// and into the caller's tensors, and the caller does the rest on its own
// stream (it fills the slots beyond the sequence and adds what arrives, +0
// included). So it stages nothing and does no local work: the schedule's
// zeroing and +0 entries are the caller's, and since nothing is staged and
// such plans are halos-only with zeros padding (Spec.validate), no copy or
// addition is ever asked of it.
type bytesOnly struct {
	mem MemoryType
}

// maxDirectSegments caps the I/O vector of a slab that cannot be packed.
const maxDirectSegments = 1 << 16

// admit checks that no slice of any shard goes to two ranks: the backward
// writes each neighbour's gradient where it belongs instead of adding it,
// so two of them must not meet on one slice. Every rank checks every
// rank's messages, so all of them fail alike.
func (bo bytesOnly) admit(part partition, L, R int64) error {
	for q, n := range part.n {
		if min(L, n)+min(R, n) > n {
			// The caller's additions of the two sides would meet.
			return fmt.Errorf("rank %d's shard of %d slices is shorter than its halos (%d + %d): a plan over %v memory needs left + right no longer than any shard; stage such layouts through a host plan",
				q, n, L, R, bo.mem)
		}
		out := part.outgoing(q, L, R)
		for i, a := range out {
			for _, b := range out[i+1:] {
				if max(a.lo, b.lo) < min(a.hi, b.hi) {
					return fmt.Errorf("rank %d's slices [%d, %d) of the global sequence go to both rank %d and rank %d: a plan over %v memory needs every slice sent at most once (halos no longer than the shards, left + right no longer than a shard); stage such layouts through a host plan",
						q, max(a.lo, b.lo), min(a.hi, b.hi), a.dst, b.dst, bo.mem)
				}
			}
		}
	}
	return nil
}

// inPlace: always, received gradients included (written, not added); a
// slab of more runs than an I/O vector takes is an error.
func (bo bytesOnly) inPlace(w *walk, elem int, accumulate bool) (bool, error) {
	if runs := w.runs(); runs > maxDirectSegments {
		return true, fmt.Errorf("a slab of %v memory is %d separate runs of memory (at most %d)", bo.mem, runs, maxDirectSegments)
	}
	return true, nil
}

// zero and addZero are the caller's.
func (bo bytesOnly) zero(w *walk, elem int, dst unsafe.Pointer)   {}
func (bo bytesOnly) addZero(w *walk, d DType, dst unsafe.Pointer) {}

func (bo bytesOnly) copy(w *walk, elem int, dst, src unsafe.Pointer) { bo.touched("copy") }
func (bo bytesOnly) add(w *walk, d DType, dst, src unsafe.Pointer)   { bo.touched("addition") }

func (bo bytesOnly) touched(what string) {
	panic(fmt.Sprintf("halo: internal error: a %s in %v memory was scheduled (a plan over it stages nothing)", what, bo.mem))
}
