/* Helpers shared by the kernels: bf16 <-> float32 by bits (with AVX2, 8 at a time); with
 * AVX2, exp of 8 floats (softmax, SiLU) and horizontal sums.
 * exp8 is the Cephes expf scheme: n = round(x / ln 2), r = x - n ln 2 in two parts, a
 * degree-6 polynomial for e^r, then 2^n through the exponent bits; ~2 ulp over the clamped
 * range [-87.3, 88.7] (below it returns ~1e-38 instead of a denormal or 0, which a softmax or
 * a SiLU cannot tell apart). glibc's scalar expf cost a 5-row step ~1 ms. */
#ifndef PAGELLM_VEC_MATH_H
#define PAGELLM_VEC_MATH_H
#include <stdint.h>

/* bf16 <-> float32 by bits: a bf16 is a float32's top half (bf16 KV pools, bf16 activations) */
static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float x) {  /* round to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } v = { x };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
/* The factor that maps a block whose largest magnitude is mx onto integer codes up to
 * `limit` (127 for int8, 32767 for int16): limit / mx, or 0 (every code 0) where mx is 0 (or
 * NaN) or so small (below limit / FLT_MAX, ~3.7e-37 for int8, ~9.6e-35 for int16: bf16 and
 * float32 hold such values) that limit / mx overflows: codes from an infinite factor would
 * be INT_MIN's saturation, the most negative code for every value of either sign. Such a
 * block's values are below any nonzero scale's half step; they quantize to 0, as int8 KV
 * rows do (store_kv_row). Every int8 / int16 quantizer of activations and K/V takes it. */
static inline float code_factor(float limit, float mx) {
    const float inv = mx > 0.f ? limit / mx : 0.f;
    return inv <= 3.4028234e38f ? inv : 0.f;  /* FLT_MAX; NaN fails too */
}

static inline float int8_code_factor(float mx) { return code_factor(127.f, mx); }
#ifdef __AVX2__
#include <immintrin.h>

static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* 8 bf16 -> float32 (exact) */
static inline __m256 load_bf16x8(const uint16_t *src) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
}

/* 8 float32 -> bf16, rounded to nearest even as f32_to_bf16 (NaN stays NaN, as 0x7fc0) */
static inline void store_bf16x8(uint16_t *dst, __m256 y) {
    /* + 0x7fff + the kept part's lowest bit, then the top half */
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, odd),
                                                   _mm256_set1_epi32(0x7fff)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    _mm_storeu_si128((__m128i *)dst, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                      _mm256_extracti128_si256(r, 1)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* silu(g) * u of 8 values, as every native gating computes it (the same bits everywhere) */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}
#endif

#ifdef __AVX512F__
/* exp8, silu_mul8, load_bf16x8 and store_bf16x8 on 16 values: the same operations lane for
 * lane, so the same bits */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

static inline __m512 silu_mul16(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u);
}

static inline __m512 load_bf16x16(const uint16_t *src) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
}

static inline void store_bf16x16(uint16_t *dst, __m512 y) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, odd),
                                                   _mm512_set1_epi32(0x7fff)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(r));
}
#endif
#endif
