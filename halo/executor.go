package halo

import "unsafe"

// executor does a plan's local work: the copies, fills and additions between
// the caller's tensors and the staging buffers, each over a walk. The
// exchange only orders that work around the wire (instance.startWith and
// complete); where it runs is the executor's business, so memory that the
// CPU must not touch (a GPU's) needs another executor (bytesOnly), not
// another exchange. Staging is local work too: while a plan is built, its
// executor says which slabs it stages and which layouts it can run at all.
type executor interface {
	// admit refuses a layout, given its agreed partition and halos, that
	// the executor cannot run; the error says why, for the plan's message.
	admit(part partition, left, right int64) error
	// inPlace says whether a slab (walk w of elem-byte elements) goes on
	// the wire straight from or into the caller's memory rather than
	// through a staging buffer; accumulate: a received slab is added to
	// what is there.
	inPlace(w *walk, elem int, accumulate bool) (bool, error)

	copy(w *walk, elem int, dst, src unsafe.Pointer)
	zero(w *walk, elem int, dst unsafe.Pointer)
	add(w *walk, d DType, dst, src unsafe.Pointer)
	addZero(w *walk, d DType, dst unsafe.Pointer)
}

// newExecutor is the executor of a plan over memory m.
func newExecutor(m MemoryType, opts *GroupOptions) executor {
	if m == MemoryHost {
		return cpu{opts}
	}
	return bytesOnly{m}
}

// cpu runs the local work on the calling thread, with the vector kernels of
// dtype.go and add_*.s. It takes a walk a row at a time (walk.rows): runs of
// up to shortRun bytes are moved by a loop of loads and stores, longer ones
// by one memmove each. It stages the slabs that its group's options
// (opts.Transfer) say are cheaper packed than sent as an I/O vector.
type cpu struct {
	opts *GroupOptions
}

// admit takes every layout: the CPU adds what arrives from several ranks.
func (c cpu) admit(partition, int64, int64) error { return nil }

// inPlace stages what is added (it is added from staging after the wait),
// and otherwise chooses by the slab's runs (bench/RESULTS.md).
func (c cpu) inPlace(w *walk, elem int, accumulate bool) (bool, error) {
	if accumulate {
		return false, nil
	}
	runs := w.runs()
	if runs <= 1 {
		return true, nil
	}
	switch c.opts.Transfer {
	case TransferPack:
		return false, nil
	case TransferIOV:
		return runs <= 1<<16, nil
	}
	return runs <= int64(c.opts.IOVMaxSegments) && w.run*int64(elem) >= c.opts.IOVMinSegment, nil
}

// largeCopy is the size of a whole copy from which stores bypass the
// cache: 8 MiB copies at 32-42 GB/s instead of 19-23 GB/s (go test -bench
// Copy ./halo/). Below it the destination is likely read again soon.
const largeCopy = 4 << 20

// shortRun is the longest run, in bytes, that a row loop moves word by word
// rather than by a memmove call per run: below it the call costs more than
// the bytes (go test -bench Gather ./halo/, bench/RESULTS.md).
const shortRun = 64

// copy copies a two-operand walk: operand 0 is the destination.
func (c cpu) copy(w *walk, elem int, dst, src unsafe.Pointer) {
	size := int(w.run) * elem
	large := w.runs()*int64(size) >= largeCopy
	e := int64(elem)
	w.rows(func(off []int64, n int64, step []int64) {
		copyRow(unsafe.Add(dst, off[0]*e), unsafe.Add(src, off[1]*e), int(n), size, step[0]*e, step[1]*e, large)
	})
}

// copyRow copies n runs of size bytes, the runs ds bytes apart in dst and
// ss bytes apart in src.
func copyRow(d, s unsafe.Pointer, n, size int, ds, ss int64, large bool) {
	if size <= shortRun {
		switch a := uintptr(size) | uintptr(ds) | uintptr(ss) | uintptr(d) | uintptr(s); {
		case a%8 == 0:
			copyFixed[uint64](d, s, n, size/8, ds, ss)
		case a%4 == 0:
			copyFixed[uint32](d, s, n, size/4, ds, ss)
		case a%2 == 0:
			copyWords[uint16](d, s, n, size/2, ds, ss)
		default:
			copyWords[uint8](d, s, n, size, ds, ss)
		}
		return
	}
	for i := range int64(n) {
		dr, sr := unsafe.Slice((*byte)(unsafe.Add(d, i*ds)), size), unsafe.Slice((*byte)(unsafe.Add(s, i*ss)), size)
		if large {
			copyLarge(dr, sr)
		} else {
			copy(dr, sr)
		}
	}
}

// copyFixed copies n runs of k aligned words of type W, each run as one
// fixed-size move where k <= 8 (the compiler emits vector loads and
// stores for it).
func copyFixed[W uint32 | uint64](d, s unsafe.Pointer, n, k int, ds, ss int64) {
	switch k {
	case 1:
		copyRuns[W](d, s, n, ds, ss)
	case 2:
		copyRuns[[2]W](d, s, n, ds, ss)
	case 3:
		copyRuns[[3]W](d, s, n, ds, ss)
	case 4:
		copyRuns[[4]W](d, s, n, ds, ss)
	case 5:
		copyRuns[[5]W](d, s, n, ds, ss)
	case 6:
		copyRuns[[6]W](d, s, n, ds, ss)
	case 7:
		copyRuns[[7]W](d, s, n, ds, ss)
	case 8:
		copyRuns[[8]W](d, s, n, ds, ss)
	default:
		copyWords[W](d, s, n, k, ds, ss)
	}
}

// copyRuns copies n runs of one T each. Addresses are computed from the
// row's start, never stepped past its last run (a pointer outside its
// allocation is invalid in Go).
func copyRuns[T any](d, s unsafe.Pointer, n int, ds, ss int64) {
	var do, so int64
	for range n {
		*(*T)(unsafe.Add(d, do)) = *(*T)(unsafe.Add(s, so))
		do, so = do+ds, so+ss
	}
}

// copyWords copies n runs of k aligned words of type T.
func copyWords[T uint8 | uint16 | uint32 | uint64](d, s unsafe.Pointer, n, k int, ds, ss int64) {
	var do, so int64
	for range n {
		dw, sw := unsafe.Slice((*T)(unsafe.Add(d, do)), k), unsafe.Slice((*T)(unsafe.Add(s, so)), k)
		for j := range dw {
			dw[j] = sw[j]
		}
		do, so = do+ds, so+ss
	}
}

// zero clears a one-operand walk.
func (c cpu) zero(w *walk, elem int, dst unsafe.Pointer) {
	size := int(w.run) * elem
	e := int64(elem)
	w.rows(func(off []int64, n int64, step []int64) {
		d, ds := unsafe.Add(dst, off[0]*e), step[0]*e
		if size > shortRun {
			for i := range n {
				clear(unsafe.Slice((*byte)(unsafe.Add(d, i*ds)), size))
			}
			return
		}
		switch a := uintptr(size) | uintptr(ds) | uintptr(d); {
		case a%8 == 0:
			zeroWords[uint64](d, int(n), size/8, ds)
		case a%4 == 0:
			zeroWords[uint32](d, int(n), size/4, ds)
		case a%2 == 0:
			zeroWords[uint16](d, int(n), size/2, ds)
		default:
			zeroWords[uint8](d, int(n), size, ds)
		}
	})
}

// zeroWords clears n runs of k aligned words of type T.
func zeroWords[T uint8 | uint16 | uint32 | uint64](d unsafe.Pointer, n, k int, ds int64) {
	var do int64
	if k == 1 {
		for range n {
			*(*T)(unsafe.Add(d, do)) = 0
			do += ds
		}
		return
	}
	for range n {
		clear(unsafe.Slice((*T)(unsafe.Add(d, do)), k))
		do += ds
	}
}

// add adds operand 1 into operand 0, elementwise in dtype d.
func (c cpu) add(w *walk, d DType, dst, src unsafe.Pointer) {
	e := int64(d.Size())
	w.rows(func(off []int64, n int64, step []int64) {
		a, b := unsafe.Add(dst, off[0]*e), unsafe.Add(src, off[1]*e)
		if w.run == 1 {
			addStrided(d, a, b, int(n), step[0]*e, step[1]*e)
			return
		}
		for i := range n {
			addInto(d, unsafe.Add(a, i*step[0]*e), unsafe.Add(b, i*step[1]*e), int(w.run))
		}
	})
}

// addZero adds +0 to a one-operand walk (see the function addZero).
func (c cpu) addZero(w *walk, d DType, dst unsafe.Pointer) {
	e := int64(d.Size())
	w.rows(func(off []int64, n int64, step []int64) {
		a := unsafe.Add(dst, off[0]*e)
		if w.run == 1 {
			z := unsafe.Pointer(&zeros[0])
			if d == Float64 {
				z = unsafe.Pointer(&zero64) // aligned for a float64 load
			}
			addStrided(d, a, z, int(n), step[0]*e, 0)
			return
		}
		for i := range n {
			addZero(d, unsafe.Add(a, i*step[0]*e), int(w.run))
		}
	})
}

// zero64 is the +0 that addZero's strided rows add in float64.
var zero64 float64

// addStrided adds n single elements, ds bytes apart in dst and ss in src,
// with the scalar arithmetic of addInto.
func addStrided(d DType, dst, src unsafe.Pointer, n int, ds, ss int64) {
	var do, so int64
	switch d {
	case Float32:
		for range n {
			*(*float32)(unsafe.Add(dst, do)) += *(*float32)(unsafe.Add(src, so))
			do, so = do+ds, so+ss
		}
	case Float64:
		for range n {
			*(*float64)(unsafe.Add(dst, do)) += *(*float64)(unsafe.Add(src, so))
			do, so = do+ds, so+ss
		}
	case Float16:
		for range n {
			a := (*uint16)(unsafe.Add(dst, do))
			*a = addF16(*a, *(*uint16)(unsafe.Add(src, so)))
			do, so = do+ds, so+ss
		}
	case BFloat16:
		for range n {
			a := (*uint16)(unsafe.Add(dst, do))
			*a = addBF16(*a, *(*uint16)(unsafe.Add(src, so)))
			do, so = do+ds, so+ss
		}
	}
}
