package halo

import "unsafe"

// executor does a plan's local work: the copies, fills and additions between
// the caller's tensors and the staging buffers, each over a walk. The
// exchange only orders that work around the wire (exchange.go); where it runs
// is the executor's business, so memory that the CPU must not touch (a GPU's)
// needs another executor, not another exchange.
type executor interface {
	copy(w *walk, elem int, dst, src unsafe.Pointer)
	zero(w *walk, elem int, dst unsafe.Pointer)
	add(w *walk, d DType, dst, src unsafe.Pointer)
	addZero(w *walk, d DType, dst unsafe.Pointer)
}

// cpu runs the local work on the calling thread, with the vector kernels of
// dtype.go and add_*.s.
type cpu struct{}

// largeCopy is the size of a whole copy from which stores bypass the
// cache: 8 MiB copies at 32-42 GB/s instead of 19-23 GB/s (go test -bench
// Copy ./halo/). Below it the destination is likely read again soon.
const largeCopy = 4 << 20

// copy copies a two-operand walk: operand 0 is the destination.
func (cpu) copy(w *walk, elem int, dst, src unsafe.Pointer) {
	n := int(w.run) * elem
	cp := func(d, s []byte) { copy(d, s) }
	if w.runs()*int64(n) >= largeCopy {
		cp = copyLarge
	}
	w.each(func(off []int64) {
		cp(unsafe.Slice((*byte)(unsafe.Add(dst, off[0]*int64(elem))), n),
			unsafe.Slice((*byte)(unsafe.Add(src, off[1]*int64(elem))), n))
	})
}

// zero clears a one-operand walk.
func (cpu) zero(w *walk, elem int, dst unsafe.Pointer) {
	n := int(w.run) * elem
	w.each(func(off []int64) {
		clear(unsafe.Slice((*byte)(unsafe.Add(dst, off[0]*int64(elem))), n))
	})
}

// add adds operand 1 into operand 0, elementwise in dtype d.
func (cpu) add(w *walk, d DType, dst, src unsafe.Pointer) {
	elem := int64(d.Size())
	w.each(func(off []int64) {
		addInto(d, unsafe.Add(dst, off[0]*elem), unsafe.Add(src, off[1]*elem), int(w.run))
	})
}

// addZero adds +0 to a one-operand walk (see the function addZero).
func (cpu) addZero(w *walk, d DType, dst unsafe.Pointer) {
	elem := int64(d.Size())
	w.each(func(off []int64) {
		addZero(d, unsafe.Add(dst, off[0]*elem), int(w.run))
	})
}
