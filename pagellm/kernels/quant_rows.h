/* Shared by the block-quantized product kernels (cpu_quant.c, cpu_gguf.c): int16 activation
 * blocks, their 32-pair integer dot product, and row passes of at most ROW_BLOCK rows. */
#ifndef PAGELLM_QUANT_ROWS_H
#define PAGELLM_QUANT_ROWS_H
#include <math.h>
#include <stdint.h>
#include "vec_math.h"
#ifdef __SSE__
#include <xmmintrin.h>
#endif

#define GROUP 32
/* At most 8 rows per pass over a weight row (its widened codes are shared by the rows); R
 * rows go in ceil(R / 8) passes of near-equal size: 9 rows as 5 + 4, 10% faster than 8 + 1
 * (a one-row pass re-reads every weight for a single row). */
#define ROW_BLOCK 8
#define ROW_BLOCKS(R) (((R) + ROW_BLOCK - 1) / ROW_BLOCK)
#define ROW_BLOCK_SIZE(R, b) ((R) / ROW_BLOCKS(R) + ((b) < (R) % ROW_BLOCKS(R)))

#ifdef __AVX2__
static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

/* xq[0..31] = x[0..31] * inv rounded to the nearest integer, ties to even (as lrintf). */
static inline void round32(const float *x, __m256 inv, int16_t *xq) {
    for (int h = 0; h < 32; h += 16) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + h), inv));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + h + 8), inv));
        /* packs interleaves 128-bit lanes: a0-3 b0-3 a4-7 b4-7 -> a0-7 b0-7 */
        _mm256_storeu_si256((__m256i *)(xq + h), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
}
#endif

/* x [R, K] -> xq [R, K] int16, dx [R, G] (block scales), xs8 [R, G, 8] (block sums of x
 * folded to 8 partial sums, xs8[j] = (x[j] + x[j + 8]) + (x[j + 16] + x[j + 24]), for the Q4
 * min term; NULL to skip). Vectorized on AVX2: a scalar pass cost a 5-row product ~30% of
 * its time (quantizing is per call, the product's weights are shared by the rows). */
static inline void quantize_rows(const float *x, int64_t R, int64_t K, int16_t *xq, float *dx, float *xs8) {
    const int64_t blocks = R * (K / GROUP);
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * GROUP;
#ifdef __AVX2__
        const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        const float mx = hmax8(_mm256_max_ps(_mm256_max_ps(abs8(v0), abs8(v1)),
                                            _mm256_max_ps(abs8(v2), abs8(v3))));
        round32(xb, _mm256_set1_ps(code_factor(32767.f, mx)), xq + b * GROUP);
        if (xs8)
            _mm256_storeu_ps(xs8 + b * 8, _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
#else
        float mx = 0.f;
        for (int j = 0; j < GROUP; j++) mx = fmaxf(mx, fabsf(xb[j]));
        const float inv = code_factor(32767.f, mx);
        for (int j = 0; j < GROUP; j++) xq[b * GROUP + j] = (int16_t)lrintf(xb[j] * inv);
        if (xs8)
            for (int j = 0; j < 8; j++) xs8[b * 8 + j] = (xb[j] + xb[j + 8]) + (xb[j + 16] + xb[j + 24]);
#endif
        dx[b] = mx / 32767.f;
    }
}

#ifdef __AVX2__
/* sum_j a_j b_j over 32 int16 pairs (a in two halves), as 8 float partial sums. */
static inline __m256 dot32(__m256i a0, __m256i a1, const int16_t *b) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(
        _mm256_madd_epi16(a0, _mm256_loadu_si256((const __m256i *)b)),
        _mm256_madd_epi16(a1, _mm256_loadu_si256((const __m256i *)(b + 16)))));
}

#endif

/* Weights stream from memory once per step, and the hardware prefetcher alone did not keep up
 * with these loops: a 1-row Q5_0 product read 4.3 GB/s from memory (a plain sum of the same
 * bytes: 16.5). Each block asks for the weight bytes PF_DIST ahead of it: 9.9 GB/s (1 KiB:
 * 8.8). Into L2 (T1), not L1: an L1 prefetch holds one of the core's few line-fill buffers
 * until it lands, and fewer lines were in flight (a 1.5B's Q4_K / Q6_K layers at one row, both
 * cores: 57.7 -> 47.2 ms; a plain sum of 1 GiB: 23.5 -> 27.1 GB/s). PREFETCH_BLOCK covers a
 * block of up to 256 bytes (K-quants), one line at a time. */
#ifndef PF_DIST
#define PF_DIST 4096
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifdef __SSE__
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PF_DIST, PF_HINT)
#else
#define PREFETCH(p) ((void)(p))
#endif
#define PREFETCH_BLOCK(p, bytes) do { \
        for (int pf_ = 0; pf_ < (bytes); pf_ += 64) PREFETCH((const char *)(p) + pf_); } while (0)

/* rb as a literal per case, so each call inlines into a fully unrolled row loop. */
#define DISPATCH(rb, CALL) switch (rb) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; \
    case 4: CALL(4); break; case 5: CALL(5); break; case 6: CALL(6); break; \
    case 7: CALL(7); break; default: CALL(8); break; }

#endif
