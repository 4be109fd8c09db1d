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
 *
 * A row's outputs have the bits it has alone, beside any other rows: each row sums in one
 * chain whatever the pass's row count, and chooses one int16 scale or a scale per block from
 * its own values (rows_quantize groups the rows by that choice). Speculative verification
 * rows then score a token as plain decoding of the request does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "quant_rows.h"

#ifdef __AVX2__
/* Whether row x [K] takes one int16 scale (the row-scaled kernels below): not when some block
 * would keep fewer than 8 significant bits (its largest value below 1/128 of the row's); then
 * its blocks need their own scales (quantize_rows). An all-zero block is exact either way.
 * *row_max: the row's largest |value|. A row's choice depends on its own values alone. */
static int takes_one_scale(const float *x, int64_t K, float *row_max) {
    float row = 0.f, least = INFINITY;
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float *xb = x + g * GROUP;
        const float mx = hmax8(_mm256_max_ps(
            _mm256_max_ps(abs8(_mm256_loadu_ps(xb)), abs8(_mm256_loadu_ps(xb + 8))),
            _mm256_max_ps(abs8(_mm256_loadu_ps(xb + 16)), abs8(_mm256_loadu_ps(xb + 24)))));
        row = mx > row ? mx : row;
        if (mx > 0.f && mx < least) least = mx;
    }
    *row_max = row;
    return !(least * 128.f < row);
}

/* Row x [K] -> xq [K] int16 with the one step *dxr = row_max / 32767, and its block sums into
 * column xsum_t [G, RS] (NULL to skip). */
static void quantize_row_scaled(const float *x, int64_t K, float row_max, int16_t *xq, float *dxr,
                                float *xsum_t, int64_t RS) {
    const __m256 inv = _mm256_set1_ps(code_factor(32767.f, row_max));
    for (int64_t g = 0; g < K / GROUP; g++) {
        const float *xb = x + g * GROUP;
        round32(xb, inv, xq + g * GROUP);
        if (xsum_t)
            xsum_t[g * RS] = hsum8(_mm256_add_ps(
                _mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24))));
    }
    *dxr = row_max / 32767.f;
}
#endif

#ifdef __AVX2__
/* One output feature, rows [0, rb) (rb <= ROW_BLOCK; a literal after inlining, so the row
 * loops unroll and the accumulators stay in registers). Q4 when sm has (scale, min) pairs. */
static inline __attribute__((always_inline)) void dot_q4(
        int rb, const int16_t *xq, const float *dx, const float *xs8, int64_t K, int64_t G,
        const uint8_t *codes, const float *sm, float *y, int64_t N) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    /* One chain per row, an add per block (the block's product and min term are formed off
     * the chain), whatever rb is: a row's sum has the same bits in any pass. */
    __m256 acc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        /* widen once, use for every row (the compiler hoists the common loads) */
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * 16)));
        __m256i lo = _mm256_and_si256(b, low), hi = _mm256_srli_epi16(b, 4);
        __m256 s = _mm256_broadcast_ss(sm + 2 * g), m = _mm256_broadcast_ss(sm + 2 * g + 1);
        for (int r = 0; r < rb; r++) {
            __m256 f = dot32(lo, hi, xq + r * K + g * GROUP);
            __m256 sc = _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * G + g));
            acc[r] = _mm256_add_ps(acc[r], _mm256_fmadd_ps(f, sc, _mm256_mul_ps(_mm256_loadu_ps(xs8 + (r * G + g) * 8), m)));
        }
    }
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]);
}

static inline __attribute__((always_inline)) void dot_q8(
        int rb, const int16_t *xq, const float *dx, int64_t K, int64_t G, const int8_t *codes,
        const float *scale, float *y, int64_t N) {
    __m256 acc[ROW_BLOCK];  /* one chain per row, as in dot_q4 */
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP)));
        __m256i c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP + 16)));
        for (int r = 0; r < rb; r++)
            acc[r] = _mm256_fmadd_ps(dot32(c0, c1, xq + r * K + g * GROUP),
                                     _mm256_mul_ps(_mm256_broadcast_ss(scale + g), _mm256_broadcast_ss(dx + r * G + g)), acc[r]);
    }
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]);
}

/* Row-scaled variants: one int16 scale per row (dxr[r]) instead of one per block, taken when
 * no block of a row is much smaller than the row's largest value (takes_one_scale), so
 * every value keeps at least 8 significant bits, bf16's precision. The block's weight scale
 * then applies once per row and block (a broadcast shared by all rows), the row scale once at
 * the end, and the Q4 min term for all rows of the block in one multiply-add over xsum_t
 * [G, RS] (block sums of x, RS >= R + 8 columns): ~40% fewer instructions per row and block. */
static inline __attribute__((always_inline)) void dot_q4_rs(
        int rb, const int16_t *xq, const float *dxr, const float *xsum_t, int64_t RS, int64_t K,
        int64_t G, const uint8_t *codes, const float *sm, float *y, int64_t N) {
    const __m256i low = _mm256_set1_epi16(0x0F);
    __m256 acc[ROW_BLOCK], mins = _mm256_setzero_ps();
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * 16)));
        __m256i lo = _mm256_and_si256(b, low), hi = _mm256_srli_epi16(b, 4);
        __m256 s = _mm256_broadcast_ss(sm + 2 * g);  /* lane r of mins: row r, as alone */
        mins = _mm256_fmadd_ps(_mm256_broadcast_ss(sm + 2 * g + 1), _mm256_loadu_ps(xsum_t + g * RS), mins);
        for (int r = 0; r < rb; r++)
            acc[r] = _mm256_fmadd_ps(dot32(lo, hi, xq + r * K + g * GROUP), s, acc[r]);
    }
    float m[8];
    _mm256_storeu_ps(m, mins);
    for (int r = 0; r < rb; r++) y[r * N] = fmaf(dxr[r], hsum8(acc[r]), m[r]);  /* one rounding in every rb */
}

static inline __attribute__((always_inline)) void dot_q8_rs(
        int rb, const int16_t *xq, const float *dxr, int64_t K, int64_t G, const int8_t *codes,
        const float *scale, float *y, int64_t N) {
    __m256 acc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP)));
        __m256i c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + g * GROUP + 16)));
        __m256 s = _mm256_broadcast_ss(scale + g);
        for (int r = 0; r < rb; r++)
            acc[r] = _mm256_fmadd_ps(dot32(c0, c1, xq + r * K + g * GROUP), s, acc[r]);
    }
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

/* The activations of one product, quantized: the rows that take one scale first (S of them:
 * xq, dxr [S], xsum_t [G, RS] their block sums), then the others (xq, dx [R - S, G] block
 * scales, xs8 [R - S, G, 8] partial block sums); order[i] is the row of x in place i. */
typedef struct {
    int64_t R, K, G, S, RS;
    int16_t *xq;
    float *dxr, *dx, *xs8, *xsum_t;
    int64_t *order;
    int permuted;
} Rows;

static void rows_free(Rows *q) {
    free(q->xq); free(q->dxr); free(q->dx); free(q->xs8); free(q->xsum_t); free(q->order);
}

/* Returns 0, or -1 when out of memory. Sums (xs8, xsum_t) only when `sums`. */
static int rows_quantize(const float *x, int64_t R, int64_t K, int sums, Rows *q) {
    const int64_t G = K / GROUP, RS = R + 8;  /* dot_q4_rs loads 8 columns of xsum_t */
    *q = (Rows){R, K, G, 0, RS, malloc(sizeof(int16_t) * R * K), malloc(sizeof(float) * R),
                malloc(sizeof(float) * R * G), sums ? malloc(sizeof(float) * R * G * 8) : NULL,
                sums ? calloc(G * RS, sizeof(float)) : NULL, malloc(sizeof(int64_t) * R), 0};
    if (!q->xq || !q->dxr || !q->dx || !q->order || (sums && (!q->xs8 || !q->xsum_t))) {
        rows_free(q);
        return -1;
    }
    int64_t next = 0;
#ifdef HAVE_ROW_SCALED
    float *row_max = q->dx;  /* scratch until the block-scaled rows are written */
    int *one = malloc(sizeof(int) * R);
    if (!one) { rows_free(q); return -1; }
    for (int64_t r = 0; r < R; r++) one[r] = takes_one_scale(x + r * K, K, &row_max[r]);
    for (int64_t r = 0; r < R; r++)
        if (one[r]) {
            quantize_row_scaled(x + r * K, K, row_max[r], q->xq + next * K, q->dxr + next,
                                sums ? q->xsum_t + next : NULL, RS);
            q->order[next++] = r;
        }
    q->S = next;
    for (int64_t r = 0; r < R; r++)
        if (!one[r]) q->order[next++] = r;
    free(one);
#else
    for (int64_t r = 0; r < R; r++) q->order[next++] = r;
#endif
    for (int64_t i = q->S; i < R; i++) {
        q->permuted |= q->order[i] != i;
        const int64_t j = i - q->S;
        quantize_rows(x + q->order[i] * K, 1, K, q->xq + i * K, q->dx + j * G,
                      sums ? q->xs8 + j * G * 8 : NULL);
    }
    return 0;
}

/* y [R, N] from the rows' outputs in their order (yp), freed after. */
static void rows_unpermute(const Rows *q, float *yp, float *y, int64_t N) {
    if (yp == y) return;
    for (int64_t i = 0; i < q->R; i++) memcpy(y + q->order[i] * N, yp + i * N, sizeof(float) * N);
    free(yp);
}

/* For each group of rows (one scale a row, then a scale a block): passes of at most
 * ROW_BLOCK rows; ONE(rb) and BLOCKS(rb) run a pass of rb rows from place i (j: its index
 * among the block-scaled rows). */
#define ROW_PASSES(q, ONE, BLOCKS) do { \
        for (int64_t b = 0, i = 0, rb; b < ROW_BLOCKS((q).S); b++, i += rb) { \
            rb = ROW_BLOCK_SIZE((q).S, b); \
            ONE(rb); \
        } \
        const int64_t rest_ = (q).R - (q).S; \
        for (int64_t b = 0, j = 0, rb; b < ROW_BLOCKS(rest_); b++, j += rb) { \
            const int64_t i = (q).S + j; \
            rb = ROW_BLOCK_SIZE(rest_, b); \
            BLOCKS(rb); \
        } } while (0)

/* x [R, K] float32, codes [N, K / 2] uint8, sm [N, K / 32, 2] float32 (scale, min) -> y [R, N].
 * Returns 0, -1 when out of memory, -2 when K is not a positive multiple of 32. */
int q4_linear(const float *x, int64_t R, int64_t K, const uint8_t *codes, const float *sm,
              int64_t N, float *y, int threads) {
    Rows q;
    if (K <= 0 || K % GROUP) return -2;
    if (R == 0) return 0;  /* (a prefill chunk with no logits: y may be NULL) */
    if (rows_quantize(x, R, K, 1, &q)) return -1;
    const int64_t G = q.G;
    float *yp = q.permuted ? malloc(sizeof(float) * R * N) : y;
    if (!yp) { rows_free(&q); return -1; }
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        PREFETCH_BLOCK(codes + n * (K / 2), (int)(K / 2));  /* the rows PF_DIST bytes ahead */
        PREFETCH_BLOCK(sm + n * G * 2, (int)(G * 8));
#ifdef HAVE_ROW_SCALED
#define Q4R(RB) dot_q4_rs(RB, q.xq + i * K, q.dxr + i, q.xsum_t + i, q.RS, K, G, codes + n * (K / 2), \
                          sm + n * G * 2, yp + i * N + n, N)
#define ONE(rb) DISPATCH(rb, Q4R)
#else
#define ONE(rb) (void)i  /* (S is 0 here: never runs) */
#endif
#define Q4(RB) dot_q4(RB, q.xq + i * K, q.dx + j * G, q.xs8 + j * G * 8, K, G, codes + n * (K / 2), \
                      sm + n * G * 2, yp + i * N + n, N)
#define BLOCKS(rb) DISPATCH(rb, Q4)
        ROW_PASSES(q, ONE, BLOCKS);
#undef Q4R
#undef Q4
#undef ONE
#undef BLOCKS
    }
    rows_unpermute(&q, yp, y, N);
    rows_free(&q);
    return 0;
}

/* x [R, K] float32, codes [N, K] int8, scale [N, K / 32] float32 -> y [R, N]. Returns as
 * q4_linear does. */
int q8_linear(const float *x, int64_t R, int64_t K, const int8_t *codes, const float *scale,
              int64_t N, float *y, int threads) {
    Rows q;
    if (K <= 0 || K % GROUP) return -2;
    if (R == 0) return 0;
    if (rows_quantize(x, R, K, 0, &q)) return -1;
    const int64_t G = q.G;
    float *yp = q.permuted ? malloc(sizeof(float) * R * N) : y;
    if (!yp) { rows_free(&q); return -1; }
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        PREFETCH_BLOCK(codes + n * K, (int)K);  /* the rows PF_DIST bytes ahead */
        PREFETCH_BLOCK(scale + n * G, (int)(G * 4));
#ifdef HAVE_ROW_SCALED
#define Q8R(RB) dot_q8_rs(RB, q.xq + i * K, q.dxr + i, K, G, codes + n * K, scale + n * G, \
                          yp + i * N + n, N)
#define ONE(rb) DISPATCH(rb, Q8R)
#else
#define ONE(rb) (void)i  /* (S is 0 here: never runs) */
#endif
#define Q8(RB) dot_q8(RB, q.xq + i * K, q.dx + j * G, K, G, codes + n * K, scale + n * G, \
                      yp + i * N + n, N)
#define BLOCKS(rb) DISPATCH(rb, Q8)
        ROW_PASSES(q, ONE, BLOCKS);
#undef Q8R
#undef Q8
#undef ONE
#undef BLOCKS
    }
    rows_unpermute(&q, yp, y, N);
    rows_free(&q);
    return 0;
}
