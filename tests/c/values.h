/* Deterministic tensor values and the oracle's arithmetic, computed from the
 * semantics alone: every rank can compute every element of the global tensor
 * and of every rank's gradient, so no data travels outside halo itself. */
#ifndef HALO_TEST_VALUES_H
#define HALO_TEST_VALUES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint64_t f64_bits(double f) { uint64_t u; memcpy(&u, &f, 8); return u; }
static double bits_f64(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {
        float v = ldexpf((float)man, -24);
        return bits_f32(f32_bits(v) | sign);
    }
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* Round to nearest even, computed through double: independent of halo's own. */
static uint16_t float_to_half(float f) {
    uint16_t sign = (f32_bits(f) >> 16) & 0x8000;
    if (f != f) return sign | 0x7e00;
    double a = fabs((double)f);
    if (a >= 65520.0) return sign | 0x7c00;
    int e;
    frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int q = e - 11; /* quantum exponent for 11 significant bits */
    if (q < -24) q = -24; /* subnormals */
    double scaled = ldexp(a, -q);
    double r = nearbyint(scaled); /* default rounding mode: ties to even */
    uint32_t m = (uint32_t)r;
    /* re-encode m * 2^q */
    if (m == 0) return sign;
    if (q == -24 && m < 1024) return sign | (uint16_t)m;
    while (m >= 2048) { m >>= 1; q++; }
    while (m < 1024) { m <<= 1; q--; }
    int exp = q + 10 + 15;
    if (exp >= 31) return sign | 0x7c00;
    return sign | (uint16_t)(exp << 10) | (uint16_t)(m & 0x3ff);
}

static float bf16_to_float(uint16_t h) { return bits_f32((uint32_t)h << 16); }
static uint16_t float_to_bf16(float f) {
    if (f != f) return 0x7fc0;
    uint32_t u = f32_bits(f);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static int dtype_size(int d) { return d == HALO_FLOAT64 ? 8 : d == HALO_FLOAT32 ? 4 : 2; }

/* A finite value of dtype d, negative zero now and then. */
static uint64_t value_bits(int d, uint64_t key) {
    uint64_t h = mix64(key);
    double v = ((double)(h >> 11) * 0x1p-53 * 2.0 - 1.0) * ldexp(1.0, (int)(h & 7) - 3);
    if (h % 23 == 0) v = -0.0;
    switch (d) {
    case HALO_FLOAT32: return f32_bits((float)v);
    case HALO_FLOAT64: return f64_bits(v);
    case HALO_FLOAT16: return float_to_half((float)v);
    default: return float_to_bf16((float)v);
    }
}

/* What torch's add_ does for one element of dtype d. */
static uint64_t add_bits(int d, uint64_t a, uint64_t b) {
    switch (d) {
    case HALO_FLOAT32: return f32_bits(bits_f32((uint32_t)a) + bits_f32((uint32_t)b));
    case HALO_FLOAT64: return f64_bits(bits_f64(a) + bits_f64(b));
    case HALO_FLOAT16: return float_to_half(half_to_float((uint16_t)a) + half_to_float((uint16_t)b));
    default: return float_to_bf16(bf16_to_float((uint16_t)a) + bf16_to_float((uint16_t)b));
    }
}

static void put_bits(unsigned char *p, int size, uint64_t v) {
    for (int i = 0; i < size; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint64_t get_bits(const unsigned char *p, int size) {
    uint64_t v = 0;
    for (int i = 0; i < size; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

#endif
