/* The LM head of greedy steps: a Q8_0 head against int8 activations, then the exact argmax
 * (pagellm/layers/greedy_head.py).
 *
 * A greedy row reads nothing of its logits but their argmax. The many-row head in bf16
 * (oneDNN) rounds both the hidden state and the logits to bf16, and its argmax differs from
 * the exact product's in ~2% of rows of the default model. Here:
 *
 * 1. Each row's hidden state h (float32) rounds per 32 values to int8: h_j ~ dx_g q_j, dx_g =
 *    max|h| / 127 over block g, so |h_j - dx_g q_j| <= dx_g / 2 (plus float32's rounding of
 *    h_j / dx_g: 0.5001 below).
 * 2. y_o = sum_g d_og dx_g sum_j c_oj q_j for every output o (c the Q8_0 codes, d their
 *    scales): vpdpbusd multiplies q_j + 128 (unsigned) by c (signed), 64 byte pairs an
 *    instruction, and each block's sum starts from -128 sum_j c_oj instead of 0 (that removes
 *    the +128; Q8_0 has no m term to scale), then one convert, multiply and FMA per 16 outputs
 *    and block. Panels of 32 outputs, tiles of 6 rows as in cpu_q32.c.
 * 3. |y_o - h . w_o| <= c B_o with B_o = sum_g dx_g A_og and A_og = d_og sum_j |c_oj| (the
 *    activations' rounding; c also holds float32's rounding over the G blocks). For the row's
 *    largest y_t, h . w_t >= y_t - c B_t: the bar. An output with y_o + c B_o below the bar
 *    is below output t exactly, so it is not the argmax. Every other one (a dozen or so of
 *    49,152 on the default model) is computed exactly, in double precision from its codes,
 *    and its logit replaced by that value. The row's argmax is then the exact product's, as
 *    torch.argmax picks it (the first of equal maxima); the other logits are y.
 *
 * A panel is searched for such outputs only if its largest y plus c times a bound of its B
 * (from A's largest value over the panel per block) reaches the bar: a few panels a row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include "q32_block.h"
#include "vec_math.h"

#define GH_TILE_R 6
#define GH_PANEL 32

int greedy_head_available(void) { return 1; }

/* h [K] float32 -> xu [K] (int8 codes + 128) and dx [K / 32]; returns 0, or -1 where a
 * value is not finite or a block's largest is too small for a finite 127 / max (below
 * ~3.7e-37, subnormals included: code_factor) */
static int quantize_row(const float *h, int64_t K, uint8_t *xu, float *dx) {
    const __m512i bias = _mm512_set1_epi32(128);
    for (int64_t g = 0; g < K / 32; g++) {
        const __m512 v0 = _mm512_loadu_ps(h + g * 32), v1 = _mm512_loadu_ps(h + g * 32 + 16);
        if (_mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
            _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), _mm512_setzero_ps(), _CMP_NEQ_UQ))
            return -1;
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0),
                                                            _mm512_abs_ps(v1)));
        const float factor = int8_code_factor(mx);
        if (mx > 0.f && factor == 0.f) return -1;  /* no bound holds (subnormals included) */
        const __m512 inv = _mm512_set1_ps(factor);
        const __m512i q0 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), bias);
        const __m512i q1 = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), bias);
        _mm_storeu_si128((__m128i *)(xu + g * 32), _mm512_cvtusepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xu + g * 32 + 16), _mm512_cvtusepi32_epi8(q1));
        dx[g] = mx / 127.f;
    }
    return 0;
}

/* Rows [0, RB) x one panel's 32 outputs (the first `cols` kept) -> y (row stride ldy; NULL:
 * not stored; stream: past the caches) and top[r * ldt]: each row's largest y over the
 * panel. Each row's values are the same whatever RB. */
static inline __attribute__((always_inline)) void tile(
        int RB, const uint8_t *xu, const float *dx, int64_t K, const int8_t *c, const float *d,
        const int32_t *nc, float *y, int64_t ldy, int cols, int stream, float *top,
        int64_t ldt, const char *pf, int64_t npf) {
    const int64_t G = K / 32;
    __m512 acc[GH_TILE_R][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const __m512i n0 = _mm512_loadu_si512(nc + g * 32), n1 = _mm512_loadu_si512(nc + g * 32 + 16);
        __m512i s[GH_TILE_R][2];
        for (int r = 0; r < RB; r++) s[r][0] = n0, s[r][1] = n1;
        block_products(RB, 0, 0, xu, K, g, G, c + g * 32 * 32, s, pf, npf);
        const __m512 d0 = _mm512_loadu_ps(d + g * 32), d1 = _mm512_loadu_ps(d + g * 32 + 16);
        for (int r = 0; r < RB; r++) {
            const __m512 a = _mm512_set1_ps(dx[r * G + g]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(d0, a),
                                        acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(d1, a),
                                        acc[r][1]);
        }
    }
    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < RB; r++) {
        /* streaming stores past the caches where a whole aligned panel row is written: the
         * logits (64 rows: 12.6 MB) would otherwise be read in before each write and push
         * the codes out of L3 (64 rows, head and argmax: 6.7 -> 6.0 ms; 8 rows 1.24 -> 1.12,
         * 128 rows 13.6 -> 11.9; the two forms alternated in one process, both cores) */
        if (!y) {  /* ids only: no logits kept */
        } else if (stream && cols == GH_PANEL && ((uintptr_t)(y + r * ldy) & 63) == 0) {
            _mm512_stream_ps(y + r * ldy, acc[r][0]);
            _mm512_stream_ps(y + r * ldy + 16, acc[r][1]);
        } else {
            _mm512_mask_storeu_ps(y + r * ldy, k0, acc[r][0]);
            _mm512_mask_storeu_ps(y + r * ldy + 16, k1, acc[r][1]);
        }
        top[r * ldt] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, k0, acc[r][0]),
                                                          _mm512_mask_mov_ps(ninf, k1, acc[r][1])));
    }
}

/* Each tile of a panel sends its share of the next panel's codes into L1, a few lines a
 * block (next_panel_share): the first tile of a panel otherwise waited on memory for its
 * codes (as in cpu_q32.c) */
#define GH_TILE(RB) do { \
        int64_t pf; \
        const int64_t npf = next_panel_share(GH_PANEL * K, GH_TILE_R, R, r, p + 1 >= P, &pf); \
        tile(RB, xu + r * K, dx + r * G, K, cp, dp, np, \
             logits ? logits + r * N + p * GH_PANEL : NULL, N, cols, 1, top + r * PT + p, PT, \
             (const char *)cp + GH_PANEL * K + pf * 64, npf); } while (0)

/* h . w_o in double precision: codes q [K] int8, scale [K / 32] */
static double exact_q8(const float *h, const int8_t *q, const float *scale, int64_t K) {
    double sum = 0.0;
    for (int64_t g = 0; g < K / 32; g++) {
        __m512d acc = _mm512_setzero_pd();
        for (int j = 0; j < 32; j += 8) {
            const __m512d qd = _mm512_cvtepi32_pd(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(q + g * 32 + j))));
            acc = _mm512_fmadd_pd(qd, _mm512_cvtps_pd(_mm256_loadu_ps(h + g * 32 + j)), acc);
        }
        sum += (double)scale[g] * _mm512_reduce_add_pd(acc);
    }
    return sum;
}

/* A row's y over the panels the search reads: the logits row itself (every panel there), or
 * with ids only a scratch row that gets a panel's y, recomputed as tile() computed it (the
 * same bits), the first time the search reads it. */
typedef struct {
    float *y;
    uint8_t *filled;  /* a scratch row's panels filled so far; NULL: y is the logits row */
    const uint8_t *xu;
    const float *dx;
    const int8_t *c;
    const float *d;
    const int32_t *nc;
} row_y_t;

static inline void panel_y(row_y_t *ry, int64_t p, int64_t K, int64_t N) {
    if (ry->filled && !ry->filled[p]) {
        const int64_t G = K / 32;
        const int cols = N - p * GH_PANEL < GH_PANEL ? (int)(N - p * GH_PANEL) : GH_PANEL;
        float top;
        tile(1, ry->xu, ry->dx, K, ry->c + p * GH_PANEL * K, ry->d + p * G * GH_PANEL,
             ry->nc + p * G * GH_PANEL, ry->y + p * GH_PANEL, 0, cols, 0, &top, 0, NULL, 0);
        ry->filled[p] = 1;
    }
}

/* One row's search: the bar, the panels that may hold the argmax, their outputs that may be
 * it, computed exactly into ry's row. Returns the exact argmax (-1 where the largest y is not
 * finite); *count: outputs computed. */
static int64_t search_row(const float *h, const float *dxr, int64_t K, const float *A,
                          const float *Amax, const int8_t *q, const float *scale, int64_t N,
                          const float *topr, int64_t PT, double c, row_y_t *ry, uint8_t *hitp,
                          int32_t *count) {
    const int64_t G = K / 32, P = (N + GH_PANEL - 1) / GH_PANEL;
    float *yr = ry->y;
    /* t: the first output of the largest y */
    int64_t pt = 0;
    for (int64_t p = 1; p < P; p++)
        if (topr[p] > topr[pt]) pt = p;
    if (!isfinite(topr[pt])) return -1;  /* overflowed products: no bound holds */
    int64_t t = pt * GH_PANEL;
    panel_y(ry, pt, K, N);
    while (yr[t] != topr[pt]) t++;
    double bt = 0.0;
    for (int64_t g = 0; g < G; g++) bt += (double)dxr[g] * A[(pt * G + g) * GH_PANEL + t % GH_PANEL];
    const double bar = (double)yr[t] - c * bt;
    /* float32 tests below, with margins over their rounding (bounds grow, the bar falls) */
    const float cf = (float)(c * (1.0 + 1e-5)), barf = (float)(bar - fabs(bar) * 1e-6) - 1e-30f;
    int64_t best = -1;
    double vbest = -INFINITY;
    int32_t n = 0;
    memset(hitp, 0, (size_t)P);
    for (int64_t p0 = 0; p0 < P; p0 += 16) {
        __m512 b = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g++)
            b = _mm512_fmadd_ps(_mm512_set1_ps(dxr[g]), _mm512_loadu_ps(Amax + g * PT + p0), b);
        __mmask16 hit = _mm512_cmp_ps_mask(
            _mm512_fmadd_ps(b, _mm512_set1_ps(cf), _mm512_loadu_ps(topr + p0)),
            _mm512_set1_ps(barf), _CMP_GE_OQ);
        if (P - p0 < 16) hit &= (__mmask16)((1u << (P - p0)) - 1);
        while (hit) {
            const int64_t p = p0 + __builtin_ctz(hit);
            hit &= hit - 1;
            hitp[p] = 1;
            panel_y(ry, p, K, N);
            const float *Ap = A + p * G * GH_PANEL;
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            for (int64_t g = 0; g < G; g++) {
                const __m512 a = _mm512_set1_ps(dxr[g]);
                b0 = _mm512_fmadd_ps(a, _mm512_loadu_ps(Ap + g * GH_PANEL), b0);
                b1 = _mm512_fmadd_ps(a, _mm512_loadu_ps(Ap + g * GH_PANEL + 16), b1);
            }
            float bo[GH_PANEL];
            _mm512_storeu_ps(bo, b0);
            _mm512_storeu_ps(bo + 16, b1);
            const int64_t o1 = (p + 1) * GH_PANEL < N ? (p + 1) * GH_PANEL : N;
            for (int64_t o = p * GH_PANEL; o < o1; o++) {
                if (!(yr[o] + cf * bo[o - p * GH_PANEL] >= barf)) continue;
                const double v = exact_q8(h, q + o * K, scale + o * G, K);
                yr[o] = (float)v;
                n++;
                if (v > vbest) vbest = v, best = o;  /* outputs in order: the first of equals */
            }
        }
    }
    if (best < 0) best = t;  /* t itself always passes; kept for safety */
    /* Rounded to float32, another output may now equal the best: the first index of the
     * largest logit must be best. Outside the searched panels no value exceeds the panel's
     * largest y, and every y left there is below the best's exact value. */
    const float fb = yr[best];
    int tie = 0;
    for (int64_t p = 0; p <= best / GH_PANEL && !tie; p++) {
        if (!hitp[p] && topr[p] < fb) continue;
        panel_y(ry, p, K, N);
        const int64_t o1 = (p + 1) * GH_PANEL < best ? (p + 1) * GH_PANEL : best;
        for (int64_t o = p * GH_PANEL; o < o1; o++)
            if (yr[o] >= fb) { tie = 1; break; }
    }
    if (tie) yr[best] = nextafterf(fb, INFINITY);
    *count = n;
    return best;
}

/* h [R, K] float32 hidden states; a Q8_0 head of N outputs as panels: codes c [P][K / 4][32][4]
 * int8, d and nc (-128 times each block's code sum, int32) [P][K / 32][32], A [P][K / 32][32]
 * (d times the sum of |codes| per block); Amax [K / 32][PT] (A's largest over each panel; PT
 * = P rounded up to 16); the file's codes q [N, K] and scales [N, K / 32] -> logits [R, N]
 * whose argmax per row is the exact product's, ids [R] that argmax, counts [R] the outputs
 * computed exactly. logits NULL: ids and counts only, the same ones (no [R, N] written: each
 * row's search recomputes the few panels it reads; 64 rows of the default model, head and
 * argmax 5.95 -> 5.63 ms). Returns 0, 1 when a hidden value is not finite or no bound holds
 * (a subnormal block, overflowed products: the caller's own head runs instead), or -1 when
 * out of memory. */
int greedy_head_q8(const float *h, int64_t R, int64_t K, const int8_t *c, const float *d,
                   const int32_t *nc, const float *A, const float *Amax, const int8_t *q,
                   const float *scale, int64_t N, float *logits, int64_t *ids,
                   int32_t *counts, int threads) {
    const int64_t G = K / 32, P = (N + GH_PANEL - 1) / GH_PANEL, PT = (P + 15) / 16 * 16;
    /* the activations' rounding (0.5 of a step, and float32's in h / dx) and float32's over
     * y's G blocks (each |term| <= 128 dx_g A_og) and over B's sums */
    const double u = 1.0 / 16777216.0;
    const double cb = (0.5001 + (double)(G + 2) * 128.0 * u) * (1.0 + 2.0 * (double)(G + 2) * u);
    uint8_t *xu = malloc((size_t)(R * K > 0 ? R * K : 1));
    float *dx = malloc(sizeof(float) * (R * G > 0 ? R * G : 1));
    float *top = malloc(sizeof(float) * (R * PT > 0 ? R * PT : 1));
    uint8_t *hits = malloc((size_t)(R * PT > 0 ? R * PT : 1));  /* each row's searched panels */
    int rc = 0;
    if (!xu || !dx || !top || !hits) { rc = -1; goto done; }
    for (int64_t r = 0; r < R; r++)
        if (quantize_row(h + r * K, K, xu + r * K, dx + r * G)) { rc = 1; goto done; }
    for (int64_t i = 0; i < R * PT; i++) top[i] = -INFINITY;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        row_y_t ry = {NULL, NULL, NULL, NULL, c, d, nc};
        if (!logits) {
            ry.y = malloc(sizeof(float) * P * GH_PANEL);
            ry.filled = malloc((size_t)P);
            if (!ry.y || !ry.filled) {
                #pragma omp atomic write
                failed = 1;
            }
        }
        #pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < P; p++) {
            const int8_t *cp = c + p * GH_PANEL * K;
            const float *dp = d + p * G * GH_PANEL;
            const int32_t *np = nc + p * G * GH_PANEL;
            const int cols = N - p * GH_PANEL < GH_PANEL ? (int)(N - p * GH_PANEL) : GH_PANEL;
            int64_t r = 0;
            for (; r + GH_TILE_R <= R; r += GH_TILE_R) GH_TILE(GH_TILE_R);
            switch (R - r) {
            case 5: GH_TILE(5); break;
            case 4: GH_TILE(4); break;
            case 3: GH_TILE(3); break;
            case 2: GH_TILE(2); break;
            case 1: GH_TILE(1); break;
            default: break;
            }
        }
        _mm_sfence();  /* this thread's streamed logits visible before the others search */
        #pragma omp barrier
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            if (failed) continue;  /* read after the barrier: every thread's write is seen */
            if (logits) {
                ry.y = logits + r * N;
            } else {
                memset(ry.filled, 0, (size_t)P);
                ry.xu = xu + r * K;
                ry.dx = dx + r * G;
            }
            ids[r] = search_row(h + r * K, dx + r * G, K, A, Amax, q, scale, N, top + r * PT, PT,
                                cb, &ry, hits + r * PT, counts + r);
        }
        if (!logits) {
            free(ry.y);
            free(ry.filled);
        }
    }
    if (failed) { rc = -1; goto done; }
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0) rc = 1;
done:
    free(xu);
    free(dx);
    free(top);
    free(hits);
    return rc;
}
#else
/* Without AVX-512 VNNI the greedy head is not offered (layers/greedy_head.py asks first). */
int greedy_head_available(void) { return 0; }

int greedy_head_q8(const float *h, int64_t R, int64_t K, const int8_t *c, const float *d,
                   const int32_t *nc, const float *A, const float *Amax, const int8_t *q,
                   const float *scale, int64_t N, float *logits, int64_t *ids,
                   int32_t *counts, int threads) {
    (void)h; (void)R; (void)K; (void)c; (void)d; (void)nc; (void)A; (void)Amax; (void)q;
    (void)scale; (void)N; (void)logits; (void)ids; (void)counts; (void)threads;
    return -1;
}
#endif
