package halo

import (
	"fmt"
	"math"
	"unsafe"
)

// DType is the element type of a tensor. Values match include/halo.h.
type DType int32

const (
	Float32  DType = 0
	Float64  DType = 1
	Float16  DType = 2
	BFloat16 DType = 3
)

// Size is the element size in bytes, 0 for an unknown dtype.
func (d DType) Size() int {
	switch d {
	case Float32:
		return 4
	case Float64:
		return 8
	case Float16, BFloat16:
		return 2
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case Float64:
		return "float64"
	case Float16:
		return "float16"
	case BFloat16:
		return "bfloat16"
	}
	return fmt.Sprintf("dtype(%d)", int32(d))
}

// addInto computes dst[i] = dst[i] + src[i] for n elements, rounding as
// PyTorch's CPU add does: float16 and bfloat16 are widened to float32, added
// in float32 and rounded to nearest-even, so results are bit-identical to
// torch's add_.
func addInto(d DType, dst, src unsafe.Pointer, n int) {
	switch d {
	case Float32:
		a, b := unsafe.Slice((*float32)(dst), n), unsafe.Slice((*float32)(src), n)
		for i := addF32Vector(a, b); i < n; i++ {
			a[i] += b[i]
		}
	case Float64:
		a, b := unsafe.Slice((*float64)(dst), n), unsafe.Slice((*float64)(src), n)
		for i := addF64Vector(a, b); i < n; i++ {
			a[i] += b[i]
		}
	case Float16:
		a, b := unsafe.Slice((*uint16)(dst), n), unsafe.Slice((*uint16)(src), n)
		for i := addF16Vector(a, b); i < n; i++ {
			a[i] = addF16(a[i], b[i])
		}
	case BFloat16:
		a, b := unsafe.Slice((*uint16)(dst), n), unsafe.Slice((*uint16)(src), n)
		for i := addBF16Vector(a, b); i < n; i++ {
			a[i] = addBF16(a[i], b[i])
		}
	}
}

// addF16 is a + b in float16 as torch's scalar CPU add computes it.
func addF16(a, b uint16) uint16 {
	s := f16Table[a] + f16Table[b]
	if s != s {
		return f16NaN(a, b, s)
	}
	return F32ToF16(s)
}

// addBF16 is a + b in bfloat16 as torch's scalar CPU add computes it.
func addBF16(a, b uint16) uint16 { return F32ToBF16(BF16ToF32(a) + BF16ToF32(b)) }

// f16NaN is the float16 NaN that torch's scalar CPU add gives for a + b:
// 0x7e00 with the sign of a if a is NaN, else of b if b is, else of the
// CPU's default NaN in s (inf - inf; negative on amd64). Where both are NaN,
// torch 1.13's vectorised loop may keep b's sign instead, depending on the
// element's position (bench/RESULTS.md).
func f16NaN(a, b uint16, s float32) uint16 {
	switch {
	case a&0x7fff > 0x7c00:
		return a&0x8000 | 0x7e00
	case b&0x7fff > 0x7c00:
		return b&0x8000 | 0x7e00
	}
	return F32ToF16(s)
}

// addZero computes dst[i] = dst[i] + 0 for n elements: what the reference
// does to boundary slices that no neighbour sent a gradient for (it adds a
// zero tensor). It only changes -0.0 into +0.0, but bit-identical means it.
func addZero(d DType, dst unsafe.Pointer, n int) {
	switch d {
	case Float32, BFloat16, Float16: // the vector kernels, a block of zeros at a time
		for done := 0; done < n; done += zeroBlock {
			k := min(zeroBlock, n-done)
			addInto(d, unsafe.Add(dst, done*d.Size()), unsafe.Pointer(&zeros[0]), k)
		}
	case Float64:
		a := unsafe.Slice((*float64)(dst), n)
		for i := range a {
			a[i] += 0
		}
	}
}

const zeroBlock = 4096

// zeros is read-only: +0 in float32, float16 and bfloat16 alike.
var zeros [zeroBlock]float32

var f16Table = func() (t [1 << 16]float32) {
	for i := range t {
		t[i] = f16ToF32Slow(uint16(i))
	}
	return
}()

// F16ToF32 widens an IEEE binary16 value exactly.
func F16ToF32(h uint16) float32 { return f16Table[h] }

func f16ToF32Slow(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h & 0x3ff)
	switch {
	case exp == 0: // zero or subnormal: man * 2^-24, exact in float32
		v := float32(man) * (1.0 / (1 << 24))
		return math.Float32frombits(math.Float32bits(v) | sign)
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

// F32ToF16 rounds to nearest-even; NaN becomes 0x7e00 with the sign kept,
// as PyTorch's conversion does.
func F32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	if exp == 0xff {
		if man != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	}
	e := exp - 112 // rebias 127 -> 15
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 { // half subnormal (or zero)
		s := uint32(126 - exp)
		if s >= 25 {
			return sign
		}
		m := man | 0x800000
		h := m >> s
		rem, half := m&(1<<s-1), uint32(1)<<(s-1)
		if rem > half || (rem == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	}
	h := uint32(e)<<10 | man>>13
	rem := man & 0x1fff
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++ // a carry into the exponent (or to infinity) is right
	}
	return sign | uint16(h)
}

// BF16ToF32 widens a bfloat16 value exactly.
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F32ToBF16 rounds to nearest-even; NaN becomes 0x7fc0, as PyTorch's does.
func F32ToBF16(f float32) uint16 {
	if f != f {
		return 0x7fc0
	}
	b := math.Float32bits(f)
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}
