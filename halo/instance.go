package halo

import (
	"fmt"
	"unsafe"
)

// instance is a plan's layout as agreed by every rank, with both
// directions' prepared work.
type instance struct {
	g        *Group
	id       uint32 // its plan's, for messages
	ident    uint64 // what its messages carry (Group.identOf of the agreement)
	specs    []Spec
	parts    []partition // one per layout, as agreed
	exec     executor    // of the layouts' memory, for the local work
	fwd, bwd schedule
}

// close releases an instance's transport resources (no exchange in flight).
func (in *instance) close() error {
	var first error
	for _, s := range []*schedule{&in.fwd, &in.bwd} {
		if s.batch != nil {
			if err := s.batch.Close(); err != nil && first == nil {
				first = err
			}
			s.batch = nil
		}
		for _, b := range s.staging {
			if err := b.Free(); err != nil && first == nil {
				first = err
			}
		}
		s.staging = nil
	}
	return first
}

// sched is direction d's schedule.
func (in *instance) sched(d Direction) *schedule {
	if d == DirBackward {
		return &in.bwd
	}
	return &in.fwd
}

// check refuses tensors that s cannot run with: a NULL where bytes are
// needed, or overlaps other than a layout's exact interior.
func (in *instance) check(s *schedule, ptrs []unsafe.Pointer) error {
	for i, name := range s.names {
		if ptrs[i] == nil && s.ext[i] > 0 {
			return fmt.Errorf("%w: rank %d: %s of plan %d: %s is NULL", ErrInvalid, in.g.Rank(), s.what, in.id, name)
		}
	}
	if err := in.aliasing(s, ptrs); err != nil {
		return fmt.Errorf("%w: rank %d: %s of plan %d: %v", ErrInvalid, in.g.Rank(), s.what, in.id, err)
	}
	return nil
}

// startWith starts s with the fixed bases given (every layout's, in order,
// checked): it packs the outgoing slabs, posts every message under call
// number seq, and then does the local work that needs nothing from the
// wire (padding, the interior, the edge ranks' +0) while the messages
// travel. That work only rewrites what a repeated start rewrites alike.
func (in *instance) startWith(s *schedule, ptrs []unsafe.Pointer, seq uint64) error {
	for i := 0; i < s.fixed; i++ {
		s.ptrs[i], s.bases[i] = ptrs[i], uintptr(ptrs[i])
	}
	x := in.exec
	for i := range s.pack {
		l := &s.pack[i]
		x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
	}
	if s.batch != nil {
		if err := s.batch.Post(s.bases, seq); err != nil {
			in.release(s)
			return in.g.fail(fmt.Errorf("rank %d: %s of plan %d: %w", in.g.Rank(), s.what, in.id, err))
		}
	}
	for i := range s.zero {
		l := &s.zero[i]
		x.zero(&l.w, l.elem, s.ptrs[l.dst])
	}
	for i := range s.fill {
		l := &s.fill[i]
		x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
	}
	for i := range s.copyIn {
		if l := &s.copyIn[i]; !s.aliased[l.layout] {
			x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
		}
	}
	for i := range s.addZero {
		l := &s.addZero[i]
		x.addZero(&l.w, l.dt, s.ptrs[l.dst])
	}
	s.inFlight = true
	return nil
}

// complete unpacks and adds what arrived, in the order of the output.
func (in *instance) complete(s *schedule) {
	x := in.exec
	for i := range s.unpack {
		l := &s.unpack[i]
		x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
	}
	for i := range s.add {
		l := &s.add[i]
		x.add(&l.w, l.dt, s.ptrs[l.dst], s.ptrs[l.src])
	}
	for i := range s.combine {
		if l := &s.combine[i]; l.add {
			x.add(&l.w, l.dt, s.ptrs[l.dst], s.ptrs[l.src])
		} else {
			x.copy(&l.w, l.elem, s.ptrs[l.dst], s.ptrs[l.src])
		}
	}
	in.release(s)
}

// release forgets the caller's tensors: the exchange no longer owns them.
func (in *instance) release(s *schedule) {
	for i := 0; i < s.fixed; i++ {
		s.ptrs[i], s.bases[i] = nil, 0
	}
	s.inFlight = false
}

// aliasing finds the padded layouts whose unpadded tensor is exactly the
// interior of the padded one (s.aliased), and refuses any other overlap
// between the caller's tensors (it would be silent garbage).
func (in *instance) aliasing(s *schedule, ptrs []unsafe.Pointer) error {
	for k, a := range s.aliases {
		inner, outer := uintptr(ptrs[a.inner]), uintptr(ptrs[a.outer])
		s.aliased[k] = s.ext[a.inner] > 0 && s.ext[a.outer] > 0 && a.off >= 0 && inner == outer+uintptr(a.off)
	}
	for i := range ptrs {
		for j := i + 1; j < len(ptrs); j++ {
			a, b := uintptr(ptrs[i]), uintptr(ptrs[j])
			if s.ext[i] == 0 || s.ext[j] == 0 || a >= b+uintptr(s.ext[j]) || b >= a+uintptr(s.ext[i]) {
				continue
			}
			if in.pairAliased(s, i, j) {
				continue
			}
			if k, ok := in.aliasPair(s, i, j); ok {
				spec := &in.specs[k]
				inner, outer := s.names[s.aliases[k].inner], s.names[s.aliases[k].outer]
				return fmt.Errorf("%s overlaps %s but is not its interior (it must be %s narrowed to slices [%d, %d) along dim %d with the same strides, or not overlap it)",
					inner, outer, outer, spec.Left, spec.Left+spec.Shape[spec.Dim], spec.Dim)
			}
			return fmt.Errorf("%s and %s overlap in memory", s.names[i], s.names[j])
		}
	}
	return nil
}

// aliasPair returns the layout whose inner and outer bases are i and j.
func (in *instance) aliasPair(s *schedule, i, j int) (int, bool) {
	for k, a := range s.aliases {
		if (a.inner == i && a.outer == j) || (a.inner == j && a.outer == i) {
			return k, true
		}
	}
	return 0, false
}

// pairAliased says whether bases i and j are a layout's tensors found to
// alias exactly.
func (in *instance) pairAliased(s *schedule, i, j int) bool {
	k, ok := in.aliasPair(s, i, j)
	return ok && s.aliased[k]
}
