#include "textflag.h"

// SSE2 kernels for the gradient additions (SSE2 is part of every amd64
// CPU, so no feature check is needed). Lane for lane they compute exactly
// what the scalar Go code in dtype.go computes.

// BF16ROUND rounds the float32 lanes of V to bfloat16 (nearest-even, NaN to
// 0x7fc0) and leaves each result sign-extended in its 32-bit lane, ready for
// PACKSSLW. Needs X10 = 0x7fff, X11 = 1, X12 = 0x7fffffff, X13 = 0x7f800000,
// X14 = 0x7fc0 in every lane; clobbers T and M.
#define BF16ROUND(V, T, M) \
	MOVO V, M; PAND X12, M; PCMPGTL X13, M; \
	MOVO V, T; PSRLL $16, T; PAND X11, T; PADDL X10, T; PADDL T, V; PSRLL $16, V; \
	MOVO M, T; PAND X14, T; PANDN V, M; POR T, M; MOVO M, V; \
	PSLLL $16, V; PSRAL $16, V

#define SPLAT(imm, X) MOVL imm, AX; MOVQ AX, X; PSHUFL $0, X, X

// func addBF16x8(dst, src *uint16, n int)
// dst[i] = bf16(f32(dst[i]) + f32(src[i])) for n elements, n a multiple of 8.
TEXT ·addBF16x8(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	SPLAT($0x7fff, X10)
	SPLAT($1, X11)
	SPLAT($0x7fffffff, X12)
	SPLAT($0x7f800000, X13)
	SPLAT($0x7fc0, X14)
bf16loop:
	CMPQ CX, $8
	JLT  bf16done
	MOVOU (DI), X0
	MOVOU (SI), X1
	PXOR X2, X2
	PUNPCKLWL X0, X2 // dst[0..3] widened: each word becomes a float32's top half
	PXOR X3, X3
	PUNPCKHWL X0, X3 // dst[4..7]
	PXOR X4, X4
	PUNPCKLWL X1, X4 // src[0..3]
	PXOR X5, X5
	PUNPCKHWL X1, X5 // src[4..7]
	ADDPS X4, X2
	ADDPS X5, X3
	BF16ROUND(X2, X6, X7)
	BF16ROUND(X3, X6, X7)
	PACKSSLW X3, X2
	MOVOU X2, (DI)
	ADDQ $16, DI
	ADDQ $16, SI
	SUBQ $8, CX
	JMP  bf16loop
bf16done:
	RET

// func addF32x4(dst, src *float32, n int)
// dst[i] += src[i] for n elements, n a multiple of 4.
TEXT ·addF32x4(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
f32loop8:
	CMPQ CX, $8
	JLT  f32loop4
	MOVUPS (DI), X0
	MOVUPS 16(DI), X1
	MOVUPS (SI), X2
	MOVUPS 16(SI), X3
	ADDPS X2, X0
	ADDPS X3, X1
	MOVUPS X0, (DI)
	MOVUPS X1, 16(DI)
	ADDQ $32, DI
	ADDQ $32, SI
	SUBQ $8, CX
	JMP  f32loop8
f32loop4:
	CMPQ CX, $4
	JLT  f32done
	MOVUPS (DI), X0
	MOVUPS (SI), X2
	ADDPS X2, X0
	MOVUPS X0, (DI)
	ADDQ $16, DI
	ADDQ $16, SI
	SUBQ $4, CX
	JMP  f32loop4
f32done:
	RET

// func copyNT(dst, src *byte, n int)
// Copies n bytes, a multiple of 64, to a 16-byte aligned dst with
// non-temporal stores: for copies larger than the caches they skip the
// read-for-ownership of every destination line.
TEXT ·copyNT(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
ntloop:
	CMPQ CX, $64
	JLT  ntdone
	MOVOU (SI), X0
	MOVOU 16(SI), X1
	MOVOU 32(SI), X2
	MOVOU 48(SI), X3
	MOVNTO X0, (DI)
	MOVNTO X1, 16(DI)
	MOVNTO X2, 32(DI)
	MOVNTO X3, 48(DI)
	ADDQ $64, SI
	ADDQ $64, DI
	SUBQ $64, CX
	JMP  ntloop
ntdone:
	SFENCE
	RET

// The kernels below need more than SSE2; add_amd64.go calls them only when
// the CPU has the features (golang.org/x/sys/cpu).

#define VSPLAT16(imm, X) MOVL imm, AX; MOVQ AX, X; VPSHUFLW $0, X, X; VPSHUFD $0, X, X

// F16SUM computes the float16 sums of the 8 lanes at off(DI) and off(SI)
// into X (Y is X widened, T and TX scratch): widened exactly (F16C), added in float32 with dst as the first
// operand (so a NaN in dst keeps its sign, as the scalar code does), rounded
// to nearest-even; a NaN result then loses its payload below the quiet bit
// (F16C keeps the payload's top bits; the scalar code gives 0x7e00 | sign).
// Needs X10 = 0x7fff, X11 = 0x7c00, X12 = 0x01ff in every word.
#define F16SUM(off, X, Y, T, TX) \
	VCVTPH2PS off(DI), Y; VCVTPH2PS off(SI), T; VADDPS T, Y, Y; VCVTPS2PH $0, Y, X; \
	VPAND X10, X, TX; VPCMPGTW X11, TX, TX; VPAND X12, TX, TX; VPANDN X, TX, X

// func addF16x16(dst, src *uint16, n int)
// dst[i] = f16(f32(dst[i]) + f32(src[i])) for n elements, n a multiple of 16.
// Needs AVX and F16C.
TEXT ·addF16x16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VSPLAT16($0x7fff, X10)
	VSPLAT16($0x7c00, X11)
	VSPLAT16($0x01ff, X12)
f16loop:
	CMPQ CX, $16
	JLT  f16done
	F16SUM(0, X0, Y0, Y2, X2)
	F16SUM(16, X1, Y1, Y3, X3)
	VMOVDQU X0, (DI)
	VMOVDQU X1, 16(DI)
	ADDQ $32, DI
	ADDQ $32, SI
	SUBQ $16, CX
	JMP  f16loop
f16done:
	VZEROUPPER
	RET

// BF16SUM computes the bfloat16 sums of the 8 lanes at off(DI) and off(SI)
// into the low words of Y's 32-bit lanes: widened by a shift, added in
// float32, rounded to nearest-even by adding 0x7fff plus the kept lsb, NaN
// to 0x7fc0. Needs Y10 = 0x7fff, Y11 = 1, Y14 = 0x7fc0 in every dword;
// clobbers T and M.
#define BF16SUM(off, Y, T, M) \
	VPMOVZXWD off(DI), Y; VPSLLD $16, Y, Y; VPMOVZXWD off(SI), T; VPSLLD $16, T, T; VADDPS T, Y, Y; \
	VCMPPS $3, Y, Y, M; \
	VPSRLD $16, Y, T; VPAND Y11, T, T; VPADDD Y10, T, T; VPADDD T, Y, Y; VPSRLD $16, Y, Y; \
	VPBLENDVB M, Y14, Y, Y

#define VSPLAT32(imm, Y, X) MOVL imm, AX; MOVQ AX, X; VPBROADCASTD X, Y

// func addBF16x16(dst, src *uint16, n int)
// dst[i] = bf16(f32(dst[i]) + f32(src[i])) for n elements, n a multiple of
// 16. Needs AVX2.
TEXT ·addBF16x16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VSPLAT32($0x7fff, Y10, X10)
	VSPLAT32($1, Y11, X11)
	VSPLAT32($0x7fc0, Y14, X14)
bf16avxloop:
	CMPQ CX, $16
	JLT  bf16avxdone
	BF16SUM(0, Y0, Y2, Y3)
	BF16SUM(16, Y1, Y4, Y5)
	VPACKUSDW Y1, Y0, Y0 // per 128-bit lane: 0-3 8-11 | 4-7 12-15
	VPERMQ $0xd8, Y0, Y0
	VMOVDQU Y0, (DI)
	ADDQ $32, DI
	ADDQ $32, SI
	SUBQ $16, CX
	JMP  bf16avxloop
bf16avxdone:
	VZEROUPPER
	RET

// func addF32x32(dst, src *float32, n int)
// dst[i] += src[i] for n elements, n a multiple of 32. Needs AVX.
TEXT ·addF32x32(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
f32avxloop:
	CMPQ CX, $32
	JLT  f32avxdone
	VMOVUPS (DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VADDPS (SI), Y0, Y0
	VADDPS 32(SI), Y1, Y1
	VADDPS 64(SI), Y2, Y2
	VADDPS 96(SI), Y3, Y3
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ $128, DI
	ADDQ $128, SI
	SUBQ $32, CX
	JMP  f32avxloop
f32avxdone:
	VZEROUPPER
	RET

// func addF64x16(dst, src *float64, n int)
// dst[i] += src[i] for n elements, n a multiple of 16. Needs AVX.
TEXT ·addF64x16(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
f64avxloop:
	CMPQ CX, $16
	JLT  f64avxdone
	VMOVUPD (DI), Y0
	VMOVUPD 32(DI), Y1
	VMOVUPD 64(DI), Y2
	VMOVUPD 96(DI), Y3
	VADDPD (SI), Y0, Y0
	VADDPD 32(SI), Y1, Y1
	VADDPD 64(SI), Y2, Y2
	VADDPD 96(SI), Y3, Y3
	VMOVUPD Y0, (DI)
	VMOVUPD Y1, 32(DI)
	VMOVUPD Y2, 64(DI)
	VMOVUPD Y3, 96(DI)
	ADDQ $128, DI
	ADDQ $128, SI
	SUBQ $16, CX
	JMP  f64avxloop
f64avxdone:
	VZEROUPPER
	RET
