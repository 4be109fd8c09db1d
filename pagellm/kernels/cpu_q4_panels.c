/* Few-row Q4 products with the codes in panels of 16 outputs, on CPUs with AVX-512 BW and VNNI
 * (pagellm/layers/quant.py NativeQ4; elsewhere NativeQ4 keeps cpu_quant.c's row layout).
 *
 * Same arithmetic as q4_linear (cpu_quant.c): w = scale * q + min per 32-value block, q in
 * 0..15; each 32-value block of x scaled to int16 (x ~ dx * xq, quantize_rows), the integer
 * block sums exact, then
 *
 *     sum_j w_j x_j ~ scale * dx * sum_j q_j xq_j + min * sum_j x_j
 *
 * Why panels: with one output's codes in a row, each 32-value block of each output costs a
 * widening, two multiply-adds, a horizontal sum, scalar scale products and broadcasts (~14
 * instructions per 20 bytes of weights): a one-row product ran at ~22 GB/s of weights, about
 * half of what memory gives two cores. Here a 512-bit register holds 16 outputs' codes for 2
 * inputs each (one int32 lane an output), so a block of 16 outputs is 8 widenings, 16
 * vpdpwssd a row with the activations broadcast, and one vector of scales and of mins for all
 * 16: ~4x fewer instructions per byte, and a lane's block sum is already whole (no horizontal
 * sum; the float part once per block and 16 outputs).
 *
 * Layout, panel p (outputs 16p .. 16p + 15, zero-padded past N), block g (inputs 32g .. +31):
 * 384 bytes = 8 groups of 32 code bytes, then 16 float32 scales, then 16 float32 mins. In group
 * c, byte 2o + t (output o, t = 0, 1) holds input 4c + t in its low nibble and input 4c + 2 + t
 * in its high one: widened to int16, lane o holds inputs (4c, 4c + 1) after a nibble mask and
 * (4c + 2, 4c + 3) after a shift by 4. Panels are consecutive [P][G][384]: each thread streams
 * its panels' bytes in order.
 *
 * Integer ranges: a lane sums 32 products of |q| <= 15 and |xq| <= 32767 (< 2^24).
 * Each output is computed by one thread: the same result on any thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include "quant_rows.h"

#define Q4P_OUT 16
#define Q4P_BYTES 384  /* per panel and block */
#define Q4P_TILE 6     /* rows a pass over a panel's codes takes */
#ifndef Q4P_PF
#define Q4P_PF 8192  /* bytes ahead (4096: 8 rows 10% slower) */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <string.h>

int q4p_available(void) { return 1; }

static inline __m512i word(const int16_t *p) {  /* two int16 activations in every lane */
    int32_t w;
    memcpy(&w, p, 4);
    return _mm512_set1_epi32(w);
}

/* Rows [0, RB) of x (row stride K) over one panel; y row stride N, the first `cols` outputs
 * written. Two integer sums a row (the low and the high nibbles): one chain of 16 dependent
 * vpdpwssd per block would bound a one-row pass by their latency. */
static inline __attribute__((always_inline)) void panel_tile(
        int RB, const int16_t *xq, const float *dx, const float *xs, int64_t K, int64_t G,
        const uint8_t *panel, float *y, int64_t N, int cols) {
    const __m512i low = _mm512_set1_epi16(0x0F);
    __m512 acc[Q4P_TILE];
    for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = panel + g * Q4P_BYTES;
#ifndef Q4P_NO_PF
        for (int l = 0; l < Q4P_BYTES; l += 64) _mm_prefetch((const char *)b + Q4P_PF + l, _MM_HINT_T1);
#endif
        __m512i s0[Q4P_TILE], s1[Q4P_TILE];
        for (int r = 0; r < RB; r++) s0[r] = s1[r] = _mm512_setzero_si512();
        for (int c = 0; c < 8; c++) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 * c)));
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_srli_epi16(v, 4);
            for (int r = 0; r < RB; r++) {
                const int16_t *xr = xq + r * K + g * GROUP + 4 * c;
                s0[r] = _mm512_dpwssd_epi32(s0[r], lo, word(xr));
                s1[r] = _mm512_dpwssd_epi32(s1[r], hi, word(xr + 2));
            }
        }
        const __m512 sc = _mm512_loadu_ps((const float *)(b + 256));
        const __m512 mn = _mm512_loadu_ps((const float *)(b + 320));
        for (int r = 0; r < RB; r++) {
            const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r]));
            acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(dx[r * G + g])),
                                     _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * G + g]), acc[r]));
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < RB; r++) _mm512_mask_storeu_ps(y + r * N, keep, acc[r]);
}

/* x [R, K] float32 (K a multiple of 32), panels [ceil(N / 16)][K / 32][384] -> y [R, N]
 * float32. Returns 0, or -1 when out of memory. */
int q4p_linear(const float *x, int64_t R, int64_t K, const uint8_t *panels, int64_t N, float *y,
               int threads) {
    const int64_t G = K / GROUP, P = (N + Q4P_OUT - 1) / Q4P_OUT;
    int16_t *xq = malloc(sizeof(int16_t) * R * K);
    float *dx = malloc(sizeof(float) * R * G), *xs8 = malloc(sizeof(float) * R * G * 8);
    float *xs = malloc(sizeof(float) * R * G);
    if (!xq || !dx || !xs8 || !xs) { free(xq); free(dx); free(xs8); free(xs); return -1; }
    quantize_rows(x, R, K, xq, dx, xs8);
    for (int64_t i = 0; i < R * G; i++) {  /* block sums for the min terms */
        const float *p = xs8 + i * 8;
        xs[i] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    }
    const int64_t tiles = (R + Q4P_TILE - 1) / Q4P_TILE;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < P; p++) {
        const uint8_t *panel = panels + p * G * Q4P_BYTES;
        const int cols = N - p * Q4P_OUT < Q4P_OUT ? (int)(N - p * Q4P_OUT) : Q4P_OUT;
        /* R rows in `tiles` passes of near-equal size (9 rows: 5 + 4) */
        for (int64_t t = 0, r0 = 0, rb; t < tiles; t++, r0 += rb) {
            rb = R / tiles + (t < R % tiles);
#define Q4P(RB) panel_tile(RB, xq + r0 * K, dx + r0 * G, xs + r0 * G, K, G, panel, \
                           y + r0 * N + p * Q4P_OUT, N, cols)
            switch (rb) {
            case 1: Q4P(1); break;
            case 2: Q4P(2); break;
            case 3: Q4P(3); break;
            case 4: Q4P(4); break;
            case 5: Q4P(5); break;
            default: Q4P(6); break;
            }
#undef Q4P
        }
    }
    free(xq); free(dx); free(xs8); free(xs);
    return 0;
}

#else
int q4p_available(void) { return 0; }

int q4p_linear(const float *x, int64_t R, int64_t K, const uint8_t *panels, int64_t N, float *y,
               int threads) {
    (void)x; (void)R; (void)K; (void)panels; (void)N; (void)y; (void)threads;
    return -2;
}
#endif
