/* Few-row products with block-quantized weights, for CPU decode steps.
 *
 * y[r, n] = sum_k x[r, k] * w[n, k] for R rows of float32 activations, where w stays in the
 * GGUF block form it was stored in (32 inputs per block, one scale per block):
 *
 *   Q4 (from Q4_0 / Q4_1): w = scale * q + min, q in 0..15, two codes per byte: byte j of a
 *       block holds element j (low nibble) and element j + 16 (high nibble), as in the file.
 *   Q8 (from Q8_0):        w = scale * q, q in -128..127.
 *
 * Each 32-value block of x is scaled to int16 (x ~ dx * xq, |xq| <= 32767): the per-element
 * error, max|x_block| / 65534, is ~250x below a bfloat16 rounding of the largest value, so the
 * product matches the float32 product with the dequantized weight to ~1e-5 relative. The
 * integer sums sum_j q_j xq_j are exact (|sum| < 32 * 128 * 32767 < 2^31), and
 *
 *   sum_j w_j x_j ~ scale * dx * sum_j q_j xq_j + min * sum_j x_j
 *
 * Widening a block's codes is shared by all rows, which keeps 2..8-row steps (speculative
 * verification, small batches) cheap. Output features are split across OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "quant_rows.h"

#ifdef __AVX2__
/* One int16 scale per row: x [R, K] -> xq, dxr [R], xsum_t [G, RS] (block sums; NULL to
 * skip); bmax [R, G] is scratch. Returns 0 without writing xq or xsum_t when some
 * block of a row would keep fewer than 8 significant bits (its largest value below 1/128 of
 * the row's): then blocks need their own scales (quantize_rows). An all-zero block is exact
 * either way. */
static int quantize_rows_scaled(const float *x, int64_t R, int64_t K, int16_t *xq, float *dxr,
                                float *xsum_t, int64_t RS, float *bmax) {
    const int64_t G = K / GROUP;
    for (int64_t r = 0; r < R; r++) {  /* block maxima, then the check, before any write */
        float row = 0.f;
        for (int64_t g = 0; g < G; g++) {
            const float *xb = x + r * K + g * GROUP;
            const float mx = hmax8(_mm256_max_ps(
                _mm256_max_ps(abs8(_mm256_loadu_ps(xb)), abs8(_mm256_loadu_ps(xb + 8))),
                _mm256_max_ps(abs8(_mm256_loadu_ps(xb + 16)), abs8(_mm256_loadu_ps(xb + 24)))));
            bmax[r * G + g] = mx;
            row = mx > row ? mx : row;
        }
        for (int64_t g = 0; g < G; g++)
            if (bmax[r * G + g] > 0.f && bmax[r * G + g] * 128.f < row) return 0;
        dxr[r] = row;  /* the row's largest value until every row passed */
    }
    for (int64_t r = 0; r < R; r++) {
        const float row = dxr[r];
        const __m256 inv = _mm256_set1_ps(row > 0.f ? 32767.f / row : 0.f);
        for (int64_t g = 0; g < G; g++) {
            const float *xb = x + r * K + g * GROUP;
            round32(xb, inv, xq + r * K + g * GROUP);
            if (xsum_t)
                xsum_t[g * RS + r] = hsum8(_mm256_add_ps(
                    _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                    _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
        }
        dxr[r] = row / 32767.f;
    }
    return 1;
}
#endif

#ifdef __AVX2__
/* One output feature, rows [0, rb) (rb <= ROW_BLOCK; a literal after inlining, so the row
 * loops unroll and the accumulators stay in registers). Q4 when sm has (scale, min) pairs. */
static inline __attribute__((always_inline)) void dot_q4(
        int rb, const int16_t *xq, const float *dx, const float *xs8, int64_t K, int64_t G,
        const uint8_t *codes, const float *sm, float *y, int64_t N) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    /* One row alternates two accumulators (even / odd blocks): its multiply-adds would
     * otherwise form one dependency chain. */
    __m256 acc[ROW_BLOCK], acc2 = _mm256_setzero_ps();
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    int64_t g = 0;
#define Q4_BLOCK(g, r, a) do { \
        __m256i b_ = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + (g) * 16))); \
        __m256 f_ = dot32(_mm256_and_si256(b_, low), _mm256_srli_epi16(b_, 4), xq + (r) * K + (g) * GROUP); \
        __m256 sc_ = _mm256_mul_ps(_mm256_broadcast_ss(sm + 2 * (g)), _mm256_broadcast_ss(dx + (r) * G + (g))); \
        a = _mm256_fmadd_ps(f_, sc_, _mm256_fmadd_ps(_mm256_loadu_ps(xs8 + ((r) * G + (g)) * 8), \
                                                      _mm256_broadcast_ss(sm + 2 * (g) + 1), a)); } while (0)
    if (rb == 1) {
        for (; g + 1 < G; g += 2) {
            Q4_BLOCK(g, 0, acc[0]);
            Q4_BLOCK(g + 1, 0, acc2);
        }
        if (g < G) Q4_BLOCK(g, 0, acc[0]);
        acc[0] = _mm256_add_ps(acc[0], acc2);
    } else {
        for (; g < G; g++) {
            /* widen once, use for every row (the compiler hoists the common loads) */
            __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * 16)));
            __m256i lo = _mm256_and_si256(b, low), hi = _mm256_srli_epi16(b, 4);
            __m256 s = _mm256_broadcast_ss(sm + 2 * g), m = _mm256_broadcast_ss(sm + 2 * g + 1);
            for (int r = 0; r < rb; r++) {
                __m256 f = dot32(lo, hi, xq + r * K + g * GROUP);
                __m256 sc = _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * G + g));
                acc[r] = _mm256_fmadd_ps(f, sc, _mm256_fmadd_ps(_mm256_loadu_ps(xs8 + (r * G + g) * 8), m, acc[r]));
            }
        }
    }
#undef Q4_BLOCK
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]);
}

static inline __attribute__((always_inline)) void dot_q8(
        int rb, const int16_t *xq, const float *dx, int64_t K, int64_t G, const int8_t *codes,
        const float *scale, float *y, int64_t N) {
    __m256 acc[ROW_BLOCK], acc2 = _mm256_setzero_ps();
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
#define Q8_WIDEN(g, c0, c1) \
        __m256i c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + (g) * GROUP))); \
        __m256i c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + (g) * GROUP + 16)))
#define Q8_ROW(g, r, c0, c1, a) \
        a = _mm256_fmadd_ps(dot32(c0, c1, xq + (r) * K + (g) * GROUP), \
                            _mm256_mul_ps(_mm256_broadcast_ss(scale + (g)), _mm256_broadcast_ss(dx + (r) * G + (g))), a)
    int64_t g = 0;
    if (rb == 1) {  /* two accumulators, as in dot_q4 */
        for (; g + 1 < G; g += 2) {
            Q8_WIDEN(g, a0, a1);
            Q8_ROW(g, 0, a0, a1, acc[0]);
            Q8_WIDEN(g + 1, b0, b1);
            Q8_ROW(g + 1, 0, b0, b1, acc2);
        }
        if (g < G) { Q8_WIDEN(g, a0, a1); Q8_ROW(g, 0, a0, a1, acc[0]); }
        acc[0] = _mm256_add_ps(acc[0], acc2);
    } else {
        for (; g < G; g++) {
            Q8_WIDEN(g, c0, c1);
            for (int r = 0; r < rb; r++) Q8_ROW(g, r, c0, c1, acc[r]);
        }
    }
#undef Q8_WIDEN
#undef Q8_ROW
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]);
}

/* Row-scaled variants: one int16 scale per row (dxr[r]) instead of one per block, taken when
 * no block of a row is much smaller than the row's largest value (quantize_rows_scaled), so
 * every value keeps at least 8 significant bits, bf16's precision. The block's weight scale
 * then applies once per row and block (a broadcast shared by all rows), the row scale once at
 * the end, and the Q4 min term for all rows of the block in one multiply-add over xsum_t
 * [G, RS] (block sums of x, RS >= R + 8 columns): ~40% fewer instructions per row and block. */
static inline __attribute__((always_inline)) void dot_q4_rs(
        int rb, const int16_t *xq, const float *dxr, const float *xsum_t, int64_t RS, int64_t K,
        int64_t G, const uint8_t *codes, const float *sm, float *y, int64_t N) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    __m256 acc[ROW_BLOCK], acc2 = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * 16)));
        __m256i lo = _mm256_and_si256(b, low), hi = _mm256_srli_epi16(b, 4);
        __m256 s = _mm256_broadcast_ss(sm + 2 * g);
        mins = _mm256_fmadd_ps(_mm256_broadcast_ss(sm + 2 * g + 1), _mm256_loadu_ps(xsum_t + g * RS), mins);
        for (int r = 0; r < rb; r++) {
            __m256 f = dot32(lo, hi, xq + r * K + g * GROUP);
            if (rb == 1 && (g & 1)) acc2 = _mm256_fmadd_ps(f, s, acc2);
            else acc[r] = _mm256_fmadd_ps(f, s, acc[r]);
        }
    }
    if (rb == 1) acc[0] = _mm256_add_ps(acc[0], acc2);
    float m[8];
    _mm256_storeu_ps(m, mins);
    for (int r = 0; r < rb; r++) y[r * N] = dxr[r] * hsum8(acc[r]) + m[r];
}

static inline __attribute__((always_inline)) void dot_q8_rs(
        int rb, const int16_t *xq, const float *dxr, int64_t K, int64_t G, const int8_t *codes,
        const float *scale, float *y, int64_t N) {
    __m256 acc[ROW_BLOCK], acc2 = _mm256_setzero_ps();
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP)));
        __m256i c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP + 16)));
        __m256 s = _mm256_broadcast_ss(scale + g);
        for (int r = 0; r < rb; r++) {
            __m256 f = dot32(c0, c1, xq + r * K + g * GROUP);
            if (rb == 1 && (g & 1)) acc2 = _mm256_fmadd_ps(f, s, acc2);
            else acc[r] = _mm256_fmadd_ps(f, s, acc[r]);
        }
    }
    if (rb == 1) acc[0] = _mm256_add_ps(acc[0], acc2);
    for (int r = 0; r < rb; r++) y[r * N] = dxr[r] * hsum8(acc[r]);
}
#define HAVE_ROW_SCALED 1
#else
/* Portable version: the same arithmetic (exact integer block sums), scalar. */
static inline void dot_q4(int rb, const int16_t *xq, const float *dx, const float *xs8, int64_t K,
                          int64_t G, const uint8_t *codes, const float *sm, float *y, int64_t N) {
    for (int r = 0; r < rb; r++) {
        float total = 0.f;
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *c = codes + g * 16;
            const int16_t *xr = xq + r * K + g * GROUP;
            int32_t t = 0;
            float xs = 0.f;
            for (int j = 0; j < 16; j++) t += (int32_t)(c[j] & 15) * xr[j] + (int32_t)(c[j] >> 4) * xr[j + 16];
            for (int j = 0; j < 8; j++) xs += xs8[(r * G + g) * 8 + j];
            total += (float)t * (sm[2 * g] * dx[r * G + g]) + sm[2 * g + 1] * xs;
        }
        y[r * N] = total;
    }
}

static inline void dot_q8(int rb, const int16_t *xq, const float *dx, int64_t K, int64_t G,
                          const int8_t *codes, const float *scale, float *y, int64_t N) {
    for (int r = 0; r < rb; r++) {
        float total = 0.f;
        for (int64_t g = 0; g < G; g++) {
            const int8_t *c = codes + g * GROUP;
            const int16_t *xr = xq + r * K + g * GROUP;
            int32_t t = 0;
            for (int j = 0; j < GROUP; j++) t += (int32_t)c[j] * xr[j];
            total += (float)t * (scale[g] * dx[r * G + g]);
        }
        y[r * N] = total;
    }
}
#endif

/* x [R, K] float32, codes [N, K / 2] uint8, sm [N, K / 32, 2] float32 (scale, min) -> y [R, N].
 * Returns 0, or -1 when out of memory. */
int q4_linear(const float *x, int64_t R, int64_t K, const uint8_t *codes, const float *sm,
              int64_t N, float *y, int threads) {
    const int64_t G = K / GROUP, RS = R + 8;  /* dot_q4_rs loads 8 columns */
    int16_t *xq = malloc(sizeof(int16_t) * R * K);
    float *dx = malloc(sizeof(float) * R * G), *xs8 = malloc(sizeof(float) * R * G * 8);
    float *xsum_t = calloc(G * RS, sizeof(float));
    if (!xq || !dx || !xs8 || !xsum_t) { free(xq); free(dx); free(xs8); free(xsum_t); return -1; }
    int row_scaled = 0;
#ifdef HAVE_ROW_SCALED
    row_scaled = quantize_rows_scaled(x, R, K, xq, dx, xsum_t, RS, xs8);  /* xs8 as scratch */
#endif
    if (!row_scaled) quantize_rows(x, R, K, xq, dx, xs8);
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        PREFETCH_BLOCK(codes + n * (K / 2), (int)(K / 2));  /* the rows PF_DIST bytes ahead */
        PREFETCH_BLOCK(sm + n * G * 2, (int)(G * 8));
        for (int64_t b = 0, r0 = 0, rb; b < ROW_BLOCKS(R); b++, r0 += rb) {
            rb = ROW_BLOCK_SIZE(R, b);
#ifdef HAVE_ROW_SCALED
            if (row_scaled) {
#define Q4R(RB) dot_q4_rs(RB, xq + r0 * K, dx + r0, xsum_t + r0, RS, K, G, codes + n * (K / 2), \
                          sm + n * G * 2, y + r0 * N + n, N)
                DISPATCH(rb, Q4R)
#undef Q4R
                continue;
            }
#endif
#define Q4(RB) dot_q4(RB, xq + r0 * K, dx + r0 * G, xs8 + r0 * G * 8, K, G, codes + n * (K / 2), \
                      sm + n * G * 2, y + r0 * N + n, N)
            DISPATCH(rb, Q4)
#undef Q4
        }
    }
    free(xq); free(dx); free(xs8); free(xsum_t);
    return 0;
}

/* x [R, K] float32, codes [N, K] int8, scale [N, K / 32] float32 -> y [R, N]. */
int q8_linear(const float *x, int64_t R, int64_t K, const int8_t *codes, const float *scale,
              int64_t N, float *y, int threads) {
    const int64_t G = K / GROUP;
    int16_t *xq = malloc(sizeof(int16_t) * R * K);
    float *dx = malloc(sizeof(float) * R * G), *bmax = malloc(sizeof(float) * R * G);
    if (!xq || !dx || !bmax) { free(xq); free(dx); free(bmax); return -1; }
    int row_scaled = 0;
#ifdef HAVE_ROW_SCALED
    row_scaled = quantize_rows_scaled(x, R, K, xq, dx, NULL, 0, bmax);
#endif
    if (!row_scaled) quantize_rows(x, R, K, xq, dx, NULL);
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        PREFETCH_BLOCK(codes + n * K, (int)K);  /* the rows PF_DIST bytes ahead */
        PREFETCH_BLOCK(scale + n * G, (int)(G * 4));
        for (int64_t b = 0, r0 = 0, rb; b < ROW_BLOCKS(R); b++, r0 += rb) {
            rb = ROW_BLOCK_SIZE(R, b);
#ifdef HAVE_ROW_SCALED
            if (row_scaled) {
#define Q8R(RB) dot_q8_rs(RB, xq + r0 * K, dx + r0, K, G, codes + n * K, scale + n * G, \
                          y + r0 * N + n, N)
                DISPATCH(rb, Q8R)
#undef Q8R
                continue;
            }
#endif
#define Q8(RB) dot_q8(RB, xq + r0 * K, dx + r0 * G, K, G, codes + n * K, scale + n * G, \
                      y + r0 * N + n, N)
            DISPATCH(rb, Q8)
#undef Q8
        }
    }
    free(xq); free(dx); free(bmax);
    return 0;
}
