/* Many-row products of K-quant weights (Q4_K, Q5_K, Q6_K) with int8 activations, for prefill
 * chunks and batched decode steps past the few-row kernels' reach.
 *
 * y[r, n] = sum_S D[r, S] d[n, S] sum_{j in S} 2^sh[r, j / 32] isc[n, j / 16] c[n, j] xq[r, j]
 *
 * over 256-value super-blocks S: xq the activations rounded to int8 per 32-value block, with
 * a power-of-two scale relative to the super-block's (quantize_i8: llama.cpp's Q8_K has one
 * scale per super-block; the shifts keep blocks up to 64x smaller at full precision, for one
 * shift per block and output), c the weight codes as unsigned bytes
 * (0..63, after the type's zero point and mins moved into an offset term that layers/int8.py
 * adds with one small float32 product over block sums), isc the integer sub-block scales
 * (Q4_K / Q5_K: 6 bits per 32 values; Q6_K: int8 per 16) and d the super-block's float scale.
 *
 * What it costs: on AVX2 cores without VNNI, integer multiplies and float FMAs share the same
 * two pipes, so what counts is multiplying instructions per 32 multiply-adds: a float32
 * product needs 4 FMAs; here one 32-value block of one row and one output is vpmaddubsw (byte
 * pairs to int16, exact: 2 * 63 * 127 < 2^15) and vpmaddwd (to int32, times the sub-block
 * scales), the int32 sums add up over the super-block (|sum| <= 8 * 64 * 2 * 16002 * 128 < 2^31),
 * and one convert + FMA per super-block: ~2.25, a ceiling 1.6-1.8x float32's (measured on a
 * Zen 3 core: 127 G int8 ops/s against 80 GFLOP/s). What it saves is memory: one byte per
 * weight instead of four. (A 32-value type's float scale per block would cost a multiply and
 * an FMA per block and output, no fewer than float32: those stay dense.)
 * With AVX-512 BW + VNNI (tile below) the same sums take 3 instructions per 64 values
 * instead of 4 per 32; measured on a Zen 5 core against the AVX2 tile, per layer of a 1.5B
 * Qwen2.5 (1536 -> 2048, 1536, 2 x 8960; 8960 -> 1536): one thread 1.20x / 1.29x / 1.22x
 * at 16 / 64 / 512 rows, two 1.04x / 1.10x / 1.37x. Where bf16 units exist the dense bf16
 * products stay 3-4x faster still (the int8 path is off there: layers/linear.py USE_INT8).
 * Tiles of 4 rows x 2 outputs (AVX-512: 4 x 4) share each loaded block; a super-block of a row chunk stays in
 * L1 while a group of outputs uses it; outputs are split across OpenMP threads, each summed
 * by one thread in a fixed order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "vec_math.h"

#define BLOCK 32
#define SUPER 256
#define TILE_R 4
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8_AVX512 1
#define TILE_N 4  /* 16 int32 sums, 4 codes, 4 scales, a row's activations: 26 of 32 registers */
#else
#define TILE_N 2
#endif
#define ROW_CHUNK 64  /* rows whose super-block (64 x 256 bytes) sits in a 32 KB L1 */
#define COL_GROUP 16  /* outputs sharing it (their 16 x 256 code bytes beside it) */
#define PANEL 4  /* super-blocks per pass over the outputs: the chunk's 64 KB of them in L2 */

/* Within each 32-value block, codes and activations are stored in the order that puts value
 * pairs of the block's first half and of its second half in alternate int16 lanes after
 * vpmaddubsw: position 4j + t holds value 2j + t (t = 0, 1) or 16 + 2j + t - 2 (t = 2, 3). A
 * broadcast int32 (first half's scale | second half's << 16) then weights every lane with its
 * half's scale in vpmaddwd (layers/int8.py BLOCK_ORDER is the same table). */
static const int8_t ORDER[BLOCK] = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23,
                                    8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31};

/* x [R, K] -> xq [R, K] int8 (ORDER within each block), dx [R, K / 256], sh [R, K / 32],
 * xs [R, K / 16]: each 32-value block is x ~ dx * 2^sh * xq (to nearest, ties to even), with
 * dx = max|x| of the super-block / (127 * 64) and sh in 0..6 the least that keeps |xq| <= 127:
 * a block up to 64x smaller than its super-block's largest keeps full int8 precision (a step within
 * 2x of its own max / 127), and the kernel applies 2^sh as a shift of the block's int32 sums.
 * xs: float sums of x over 16 values, for the offset term. */
void quantize_i8(const float *x, int64_t R, int64_t K, int8_t *xq, float *dx, uint8_t *sh,
                 float *xs) {
    const int64_t supers = R * (K / SUPER);
    for (int64_t b = 0; b < supers; b++) {
        const float *xb = x + b * SUPER;
        float bmax[SUPER / BLOCK], mx = 0.f;
        for (int g = 0; g < SUPER / BLOCK; g++) {
            float m = 0.f;
            for (int j = 0; j < BLOCK; j++) m = fmaxf(m, fabsf(xb[g * BLOCK + j]));
            bmax[g] = m;
            mx = fmaxf(mx, m);
        }
        const float unit = mx / (127.f * 64.f);
        for (int g = 0; g < SUPER / BLOCK; g++) {
            int shift = 0;
            while (shift < 6 && bmax[g] > 127.f * unit * (float)(1 << shift)) shift++;
            /* the block's step unit 2^shift: a tiny super-block's may be 0, or its reciprocal
             * past FLT_MAX; then codes of 0 (code_factor) */
            const float inv = code_factor(1.f, unit * (float)(1 << shift));
            const float *xg = xb + g * BLOCK;
            int8_t *qg = xq + b * SUPER + g * BLOCK;
            for (int j = 0; j < BLOCK; j++) {
                const long q = lrintf(xg[ORDER[j]] * inv);
                qg[j] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
            }
            sh[b * (SUPER / BLOCK) + g] = (uint8_t)shift;
        }
        for (int h = 0; h < SUPER / 16; h++) {
            float t = 0.f;
            for (int j = 0; j < 16; j++) t += xb[16 * h + j];
            xs[b * (SUPER / 16) + h] = t;
        }
        dx[b] = unit;
    }
}

#ifdef INT8_AVX512
/* Adds super-block sb of rows [0, RB) x outputs [0, NB) into y (RB, NB literals after
 * inlining). AVX-512 BW + VNNI: a register holds two 32-value blocks (lanes 0-7 the first,
 * 8-15 the second), and the power-of-two shift moves from the int32 sums onto the int16
 * sub-block scales (vpsllvw: a 6-bit scale << 6 and Q6_K's |int8| << 6 stay below 2^15), so
 * that vpdpwssd multiplies by the shifted scales and accumulates in one instruction: 3 per 64
 * values of a row and output (vpmaddubsw, vpsllvw, vpdpwssd) against the AVX2 path's 4 per 32.
 * A lane sums 4 vpdpwssd of a super-block: <= 4 * 2 * 16002 * 8192 < 2^31. The same integer
 * terms as the AVX2 path; the lanes convert to float before they add, as there. */
static inline __attribute__((always_inline)) void tile(
        int RB, int NB, int64_t sb, const int8_t *xq, const float *dx, const uint8_t *sh,
        int64_t K, const uint8_t *c, const float *d, const int32_t *isc, float *y, int64_t ldy) {
    const int64_t S = K / SUPER, G = K / BLOCK;
    __m512i sum[TILE_R][TILE_N];
    for (int r = 0; r < RB; r++)
        for (int n = 0; n < NB; n++) sum[r][n] = _mm512_setzero_si512();
    for (int64_t g = sb * (SUPER / BLOCK); g < (sb + 1) * (SUPER / BLOCK); g += 2) {
        __m512i w[TILE_N], hs[TILE_N];
        for (int n = 0; n < NB; n++) {
            w[n] = _mm512_loadu_si512((const void *)(c + n * K + g * BLOCK));
            hs[n] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(isc[n * G + g])),
                                       _mm256_set1_epi32(isc[n * G + g + 1]), 1);
        }
        for (int r = 0; r < RB; r++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + r * K + g * BLOCK));
            const __m512i shift = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi16(sh[r * G + g])),
                _mm256_set1_epi16(sh[r * G + g + 1]), 1);
            for (int n = 0; n < NB; n++)
                sum[r][n] = _mm512_dpwssd_epi32(sum[r][n], _mm512_maddubs_epi16(w[n], xv), _mm512_sllv_epi16(
                                                hs[n], shift));
        }
    }
    for (int r = 0; r < RB; r++)
        for (int n = 0; n < NB; n++)
            y[r * ldy + n] += d[n * S + sb] * dx[r * S + sb] *
                              _mm512_reduce_add_ps(_mm512_cvtepi32_ps(sum[r][n]));
}
#elif defined(__AVX2__)
/* Adds super-block sb of rows [0, RB) x outputs [0, NB) into y (RB, NB literals after
 * inlining: the loops unroll and the int32 sums stay in registers). */
static inline __attribute__((always_inline)) void tile(
        int RB, int NB, int64_t sb, const int8_t *xq, const float *dx, const uint8_t *sh,
        int64_t K, const uint8_t *c, const float *d, const int32_t *isc, float *y, int64_t ldy) {
    const int64_t S = K / SUPER, G = K / BLOCK;
    __m256i sum[TILE_R][TILE_N];
    for (int r = 0; r < RB; r++)
        for (int n = 0; n < NB; n++) sum[r][n] = _mm256_setzero_si256();
    for (int64_t g = sb * (SUPER / BLOCK); g < (sb + 1) * (SUPER / BLOCK); g++) {
        __m256i w[TILE_N], hs[TILE_N];
        for (int n = 0; n < NB; n++) {
            w[n] = _mm256_loadu_si256((const __m256i *)(c + n * K + g * BLOCK));
            hs[n] = _mm256_set1_epi32(isc[n * G + g]);
        }
        for (int r = 0; r < RB; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + g * BLOCK));
            const __m128i shift = _mm_cvtsi32_si128(sh[r * G + g]);
            for (int n = 0; n < NB; n++)
                sum[r][n] = _mm256_add_epi32(sum[r][n], _mm256_sll_epi32(_mm256_madd_epi16(
                    _mm256_maddubs_epi16(w[n], xv), hs[n]), shift));
        }
    }
    for (int r = 0; r < RB; r++)
        for (int n = 0; n < NB; n++)
            y[r * ldy + n] += d[n * S + sb] * dx[r * S + sb] * hsum8(_mm256_cvtepi32_ps(sum[r][n]));
}
#else
/* Portable version: the same integer super-block sums, scalar. */
static inline void tile(int RB, int NB, int64_t sb, const int8_t *xq, const float *dx,
                        const uint8_t *sh, int64_t K, const uint8_t *c, const float *d,
                        const int32_t *isc, float *y, int64_t ldy) {
    const int64_t S = K / SUPER, G = K / BLOCK;
    for (int r = 0; r < RB; r++)
        for (int n = 0; n < NB; n++) {
            int32_t t = 0;
            for (int64_t j = sb * SUPER; j < (sb + 1) * SUPER; j++) {
                const int32_t pair = isc[n * G + j / BLOCK];  /* ORDER: lanes t = 2, 3 */
                const int32_t sc = (j & 2) ? (int16_t)(pair >> 16) : (int16_t)(pair & 0xFFFF);
                t += ((int32_t)c[n * K + j] * xq[r * K + j] * sc) << sh[r * G + j / BLOCK];
            }
            y[r * ldy + n] += (float)t * (d[n * S + sb] * dx[r * S + sb]);
        }
}
#endif

#define TILE_CASE(RB, NB) tile(RB, NB, sb, xq + r * K, dx + r * S, sh + r * G, K, c + n * K, \
                               d + n * S, isc + n * G, y + r * ldy + n, ldy)

/* Rows [r0, r1) x outputs [n0, n1) over super-blocks [s0, s1), one super-block at a time: a
 * super-block of the chunk's rows (ROW_CHUNK x 256 bytes) stays in L1 while every output of
 * the group uses it. */
static void group(const int8_t *xq, const float *dx, const uint8_t *sh, int64_t r0, int64_t r1,
                  int64_t K,
                  const uint8_t *c, const float *d, const int32_t *isc, int64_t n0, int64_t n1,
                  int64_t s0, int64_t s1, float *y, int64_t ldy) {
    const int64_t S = K / SUPER, G = K / BLOCK;
    if (s0 == 0)
        for (int64_t r = r0; r < r1; r++)
            for (int64_t n = n0; n < n1; n++) y[r * ldy + n] = 0.f;
    for (int64_t sb = s0; sb < s1; sb++) {
        int64_t n = n0;
        for (; n + TILE_N <= n1; n += TILE_N) {
            int64_t r = r0;
            for (; r + TILE_R <= r1; r += TILE_R) TILE_CASE(TILE_R, TILE_N);
            switch (r1 - r) {
            case 3: TILE_CASE(3, TILE_N); break;
            case 2: TILE_CASE(2, TILE_N); break;
            case 1: TILE_CASE(1, TILE_N); break;
            default: break;
            }
        }
        for (; n < n1; n++) {  /* the group's last outputs, one at a time */
            int64_t r = r0;
            for (; r + TILE_R <= r1; r += TILE_R) TILE_CASE(TILE_R, 1);
            switch (r1 - r) {
            case 3: TILE_CASE(3, 1); break;
            case 2: TILE_CASE(2, 1); break;
            case 1: TILE_CASE(1, 1); break;
            default: break;
            }
        }
    }
}

/* xq [R, K] int8, dx [R, K / 256], sh [R, K / 32] (quantize_i8), codes [N, K] uint8 (0..63, ORDER within each
 * block), d [N, K / 256], isc [N, K / 32] int32 (the halves' int16 scales) -> y [R, N] with row stride ldy >= N (a fused projection's part writes
 * its own columns), without the offset term. K a multiple of 256. */
void i8_linear(const int8_t *xq, const float *dx, const uint8_t *sh, int64_t R, int64_t K,
               const uint8_t *c,
               const float *d, const int32_t *isc, int64_t N, float *y, int64_t ldy, int threads) {
    const int64_t groups = (N + COL_GROUP - 1) / COL_GROUP, S = K / SUPER;
    for (int64_t r0 = 0; r0 < R; r0 += ROW_CHUNK) {
        const int64_t r1 = r0 + ROW_CHUNK < R ? r0 + ROW_CHUNK : R;
        for (int64_t s0 = 0; s0 < S; s0 += PANEL) {
            const int64_t s1 = s0 + PANEL < S ? s0 + PANEL : S;
            #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
            for (int64_t q = 0; q < groups; q++) {
                const int64_t n0 = q * COL_GROUP, n1 = n0 + COL_GROUP < N ? n0 + COL_GROUP : N;
                group(xq, dx, sh, r0, r1, K, c, d, isc, n0, n1, s0, s1, y, ldy);
            }
        }
    }
}
