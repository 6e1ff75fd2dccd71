package halo

import (
	"fmt"
	"slices"

	"github.com/halo-cp/halo/halo/transport"
)

// The local layout a plan is made for, and its validation.

// MemoryType says where a layout's tensors live (include/halo.h's
// halo_memory_type_t); the transport's operations carry it.
type MemoryType = transport.Memory

const (
	MemoryHost = transport.Host
	MemoryCUDA = transport.CUDA
)

// Padding says what fills halo slices outside the global sequence: the
// padding modes of torch.nn.Conv3d (see include/halo.h for the gradients'
// order).
type Padding int32

const (
	PadZeros     Padding = 0 // the reference's behaviour
	PadReplicate Padding = 1 // the edge slice repeated
	PadReflect   Padding = 2 // mirrored about the edge slice, which is not repeated
	PadCircular  Padding = 3 // wrapped around the sequence
)

// String is the mode as torch spells padding_mode.
func (m Padding) String() string {
	switch m {
	case PadZeros:
		return "zeros"
	case PadReplicate:
		return "replicate"
	case PadReflect:
		return "reflect"
	case PadCircular:
		return "circular"
	}
	return fmt.Sprintf("padding(%d)", int32(m))
}

// Spec is the local layout a plan is made for. Strides are in elements; nil
// means contiguous. The out tensor has x's shape with Left+Right more slices
// along Dim; the gradient tensors have the shapes of out and x.
type Spec struct {
	DType          DType
	Shape          []int64
	XStrides       []int64
	OutStrides     []int64
	GradOutStrides []int64 // nil: same as OutStrides
	GradXStrides   []int64 // nil: same as XStrides
	Dim            int
	Left, Right    int64
	Padding        Padding

	// HalosOnly: the halos go to and come from tensors of their own (left
	// and right, x's shape with Left and Right slices along Dim) instead of
	// a padded out, and backward adds the neighbours' gradients into a
	// grad_x that already holds the rest. The wire does not see the
	// difference: ranks may mix padded and halos-only plans.
	HalosOnly bool
	// Strides of the halos-only tensors; nil means contiguous, the
	// gradients' nil means the same as their tensor's.
	LeftStrides, RightStrides         []int64
	GradLeftStrides, GradRightStrides []int64

	// Memory is where all of the layout's tensors live. A plan over memory
	// the CPU must not touch (CUDA) only moves bytes; see bytesOnly.
	Memory MemoryType
}

// OutShape is the shape of the forward output.
func (s *Spec) OutShape() []int64 {
	o := append([]int64(nil), s.Shape...)
	if s.Dim >= 0 && s.Dim < len(o) {
		o[s.Dim] += s.Left + s.Right
	}
	return o
}

// haloShape is the shape of a halo tensor of k slices.
func (s *Spec) haloShape(k int64) []int64 {
	h := slices.Clone(s.Shape)
	h[s.Dim] = k
	return h
}

// layoutName prefixes messages about layout k of a plan of n layouts.
func layoutName(k, n int) string {
	if n == 1 {
		return ""
	}
	return fmt.Sprintf("layout %d: ", k)
}

func (s *Spec) validate() error {
	nd := len(s.Shape)
	if nd < 1 || nd > MaxDims {
		return fmt.Errorf("ndim %d is out of range [1, %d]", nd, MaxDims)
	}
	if s.DType.Size() == 0 {
		return fmt.Errorf("unknown dtype %d", int32(s.DType))
	}
	if s.Dim < 0 || s.Dim >= nd {
		return fmt.Errorf("dim %d is out of range for a %d-d tensor", s.Dim, nd)
	}
	if s.Left < 0 || s.Right < 0 {
		return fmt.Errorf("halo sizes must not be negative (left %d, right %d)", s.Left, s.Right)
	}
	if s.Padding < PadZeros || s.Padding > PadCircular {
		return fmt.Errorf("unknown padding %d (want zeros 0, replicate 1, reflect 2 or circular 3)", int32(s.Padding))
	}
	if s.Memory != MemoryHost && s.Memory != MemoryCUDA {
		return fmt.Errorf("unknown memory type %d", int32(s.Memory))
	}
	if s.Memory != MemoryHost && !s.HalosOnly {
		return fmt.Errorf("a plan over %v memory must be halos-only (the interior copy and the padding are the caller's work)", s.Memory)
	}
	if s.Memory != MemoryHost && s.Padding != PadZeros {
		return fmt.Errorf("a plan over %v memory pads with zeros only (the caller fills the slots beyond the sequence), not %v: stage other modes through a host plan", s.Memory, s.Padding)
	}
	for i, n := range s.Shape {
		if n < 0 {
			return fmt.Errorf("shape[%d] = %d is negative", i, n)
		}
	}
	if s.Left > 1<<40 || s.Right > 1<<40 || s.Shape[s.Dim] > 1<<40 {
		return fmt.Errorf("sizes along dim %d are too large (left %d, shard %d, right %d)", s.Dim, s.Left, s.Shape[s.Dim], s.Right)
	}
	type layout struct {
		name     string
		shape    []int64
		strides  []int64
		writable bool
	}
	ls := []layout{{"x", s.Shape, s.XStrides, false}, {"grad_x", s.Shape, s.GradXStrides, true}}
	if s.HalosOnly {
		left, right := s.haloShape(s.Left), s.haloShape(s.Right)
		ls = append(ls, layout{"left", left, s.LeftStrides, true}, layout{"right", right, s.RightStrides, true},
			layout{"grad_left", left, s.GradLeftStrides, false}, layout{"grad_right", right, s.GradRightStrides, false})
	} else {
		out := s.OutShape()
		ls = append(ls, layout{"out", out, s.OutStrides, true}, layout{"grad_out", out, s.GradOutStrides, false})
	}
	for _, l := range ls {
		if l.strides == nil {
			if _, err := extent(l.shape, ContiguousStrides(l.shape), s.DType.Size()); err != nil {
				return fmt.Errorf("%s of shape %v: %v", l.name, l.shape, err)
			}
			continue
		}
		if len(l.strides) != nd {
			return fmt.Errorf("%s has %d strides for %d dims", l.name, len(l.strides), nd)
		}
		if err := checkStrides(l.shape, l.strides, s.DType.Size(), l.writable); err != nil {
			return fmt.Errorf("%s of shape %v: %v", l.name, l.shape, err)
		}
	}
	return nil
}

func (s Spec) normalized() Spec {
	s.Shape = append([]int64(nil), s.Shape...)
	or := func(a, b []int64) []int64 {
		if a == nil {
			return append([]int64(nil), b...)
		}
		return append([]int64(nil), a...)
	}
	s.XStrides = or(s.XStrides, ContiguousStrides(s.Shape))
	s.OutStrides = or(s.OutStrides, ContiguousStrides(s.OutShape()))
	s.GradOutStrides = or(s.GradOutStrides, s.OutStrides)
	s.GradXStrides = or(s.GradXStrides, s.XStrides)
	if s.HalosOnly {
		s.OutStrides, s.GradOutStrides = nil, nil
		s.LeftStrides = or(s.LeftStrides, ContiguousStrides(s.haloShape(s.Left)))
		s.RightStrides = or(s.RightStrides, ContiguousStrides(s.haloShape(s.Right)))
		s.GradLeftStrides = or(s.GradLeftStrides, s.LeftStrides)
		s.GradRightStrides = or(s.GradRightStrides, s.RightStrides)
	}
	return s
}
