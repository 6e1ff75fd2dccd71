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
