/* Few-row GGUF products on CPUs with AVX-512 BW and VNNI (cpu_gguf.c calls gguf_avx512 there;
 * elsewhere this file compiles to nothing). Same contract as gguf_linear: y [R, N] = x [R, K]
 * times the file's blocks, exact integer block sums, each output summed by one thread.
 *
 * What differs from the AVX2 path, and why it is faster per byte of weight:
 * - 32 int16 codes per 512-bit register in the file's natural order (vpmovzxbw of the bytes,
 *   a nibble mask or shift; Q5's fifth bits are a 32-bit mask register for one masked add), so
 *   activations need no de-interleaving;
 * - vpdpwssd multiplies and accumulates 32 int16 pairs into 16 int32 lanes in one instruction;
 * - K-quants: activations get one int16 scale per 256-value super-block (not per 32), so each
 *   code is multiplied by its integer sub-block scale once (vpmullw, shared by every row) and a
 *   row's whole super-block sums in int32 lanes, then one convert and one FMA per block and row
 *   (the AVX2 path converts and scales every 32-value sub-block of every row). int16 steps of
 *   max|x| / 32767 over 256 values are still 256x finer than int8 steps over 32.
 *
 * Integer ranges (no lane can overflow): Q4_K / Q5_K codes c <= 31 times scales <= 63 give
 * <= 1953; Q6_K (q - 32) in [-32, 31] times int8 scales gives |.| <= 4096; |xq| <= 32767; a lane
 * sums 16 products of a super-block: <= 16 * 4096 * 32767 < 2^31. 32-value types: a fresh int32
 * sum per block.
 */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gguf_types.h"

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i load_x(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* x [R, K] -> xq [R, K] int16 (x / step rounded to nearest, ties to even), dx [R, K / A] the
 * steps (max|x| of each A values / 32767), xs [R, K / 32] float sums of 32 values (min terms). */
static void quantize(const float *x, int64_t R, int64_t K, int A, int16_t *xq, float *dx, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t a = 0; a < R * K / A; a++) {
        const float *xa = x + a * A;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < A; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xa + j)));
        const float mx = hmax8(m);
        const __m256 inv = _mm256_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
        for (int j = 0; j < A; j += 32) {
            __m256 sum = _mm256_setzero_ps();
            for (int h = 0; h < 32; h += 8) {
                const __m256 v = _mm256_loadu_ps(xa + j + h);
                _mm_storeu_si128((__m128i *)(xq + a * A + j + h), _mm256_cvtsepi32_epi16(_mm256_cvtps_epi32(_mm256_mul_ps(v, inv))));
                sum = _mm256_add_ps(sum, v);
            }
            xs[(a * A + j) / 32] = hsum8(sum);
        }
        dx[a] = mx / 32767.f;
    }
}

/* Rows [0, rb) of one output feature over a weight row of 32-value blocks. */
static inline __attribute__((always_inline)) void row_32(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int64_t G = K / 32;
    const int size = bytes_of(type), has_min = type == T_Q4_1 || type == T_Q5_1;
    __m256 acc[ROW_BLOCK], acc2 = _mm256_setzero_ps();
    float mins[ROW_BLOCK];
    for (int r = 0; r < rb; r++) { acc[r] = _mm256_setzero_ps(); mins[r] = 0.f; }
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = row + g * size;
        PREFETCH(b);
        const float d = f16(b), m = has_min ? f16(b + 2) : 0.f;
        __m256i c0, c1;  /* values 0-15, 16-31 */
        if (type == T_Q8_0) {
            c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
            c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
        } else {
            const int five = type == T_Q5_0 || type == T_Q5_1;
            const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2 + 2 * has_min + 4 * five)));
            c0 = _mm256_and_si256(v, _mm256_set1_epi16(15));
            c1 = _mm256_srli_epi16(v, 4);
            if (five) {  /* bit j of qh: 16 more for value j */
                uint32_t qh;
                memcpy(&qh, b + 2 + 2 * has_min, 4);
                const __m256i sixteen = _mm256_set1_epi16(16);
                c0 = _mm256_mask_add_epi16(c0, (__mmask16)(qh & 0xFFFF), c0, sixteen);
                c1 = _mm256_mask_add_epi16(c1, (__mmask16)(qh >> 16), c1, sixteen);
            }
            if (!has_min) {
                const __m256i off = _mm256_set1_epi16(five ? 16 : 8);
                c0 = _mm256_sub_epi16(c0, off);
                c1 = _mm256_sub_epi16(c1, off);
            }
        }
        for (int r = 0; r < rb; r++) {
            const int16_t *xr = xq + r * K + g * 32;
            const __m256i t = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), c0, load_x(xr)), c1, load_x(xr + 16));
            const __m256 sc = _mm256_set1_ps(d * dx[r * G + g]);
            /* one row alternates two accumulators: a single chain would serialise */
            if (rb == 1 && (g & 1)) acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, acc2);
            else acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, acc[r]);
            if (has_min) mins[r] += m * xs[r * G + g];
        }
    }
    if (rb == 1) acc[0] = _mm256_add_ps(acc[0], acc2);
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]) + mins[r];
}

/* Rows [0, rb) of one output feature over a weight row of 256-value K-quant blocks (dx: one
 * step per 256 values). Each block's codes, times their integer sub-block scales, are made
 * once and multiplied into every row's two int32 accumulators. */
static inline __attribute__((always_inline)) void row_k(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int64_t U = K / 256, G = K / 32;
    const int size = bytes_of(type), has_min = type != T_Q6_K;
    __m256 acc[ROW_BLOCK], macc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
#define DOT(SUM, CODE, OFFSET) \
    for (int r = 0; r < rb; r++) SUM[r] = _mm256_dpwssd_epi32(SUM[r], CODE, load_x(xb + r * K + (OFFSET)))
    for (int64_t u = 0; u < U; u++) {
        const uint8_t *b = row + u * size;
        PREFETCH_BLOCK(b, size);
        const int16_t *xb = xq + u * 256;
        __m256i ia[ROW_BLOCK], ib[ROW_BLOCK];
        for (int r = 0; r < rb; r++) { ia[r] = _mm256_setzero_si256(); ib[r] = _mm256_setzero_si256(); }
        float d;
        if (has_min) {  /* Q4_K / Q5_K */
            d = f16(b);
            uint64_t scales, mins;
            k4_scales_mins(b, &scales, &mins);
            const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)),
                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins))));
            for (int r = 0; r < rb; r++)
                macc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + r * G + u * 8), macc[r]);
            /* sub-block scales as int16 lanes, each spread over a register by one permute */
            const __m256i s16 = _mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales));
            const int five = type == T_Q5_K;
            const uint8_t *qs = b + (five ? 48 : 16);
            const __m256i f = _mm256_set1_epi16(15), sixteen = _mm256_set1_epi16(16);
            const __m256i h0 = five ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 16))) : f;
            const __m256i h1 = five ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 32))) : f;
            for (int c = 0; c < 4; c++) {
                /* values 0-15 and 16-31 of sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * c)));
                const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * c + 16)));
                __m256i l0 = _mm256_and_si256(v0, f), l1 = _mm256_and_si256(v1, f);
                __m256i g0 = _mm256_srli_epi16(v0, 4), g1 = _mm256_srli_epi16(v1, 4);
                if (five) {  /* bits 2c and 2c + 1 of each value's qh byte */
                    const __m256i bl = _mm256_set1_epi16((short)(1 << (2 * c))), bh = _mm256_set1_epi16((short)(2 << (2 * c)));
                    l0 = _mm256_mask_add_epi16(l0, _mm256_test_epi16_mask(h0, bl), l0, sixteen);
                    l1 = _mm256_mask_add_epi16(l1, _mm256_test_epi16_mask(h1, bl), l1, sixteen);
                    g0 = _mm256_mask_add_epi16(g0, _mm256_test_epi16_mask(h0, bh), g0, sixteen);
                    g1 = _mm256_mask_add_epi16(g1, _mm256_test_epi16_mask(h1, bh), g1, sixteen);
                }
                const __m256i sl = _mm256_permutexvar_epi16(_mm256_set1_epi16((short)(2 * c)), s16);
                const __m256i sh = _mm256_permutexvar_epi16(_mm256_set1_epi16((short)(2 * c + 1)), s16);
                l0 = _mm256_mullo_epi16(l0, sl); l1 = _mm256_mullo_epi16(l1, sl);
                g0 = _mm256_mullo_epi16(g0, sh); g1 = _mm256_mullo_epi16(g1, sh);
                DOT(ia, l0, 64 * c); DOT(ib, l1, 64 * c + 16);
                DOT(ia, g0, 64 * c + 32); DOT(ib, g1, 64 * c + 48);
            }
        } else {  /* Q6_K: per half of 128 values, 8 x 16 codes, an int8 scale per 16 */
            d = f16(b + 208);
            const __m256i f = _mm256_set1_epi16(15), t = _mm256_set1_epi16(0x30), k32 = _mm256_set1_epi16(32);
            for (int hf = 0; hf < 2; hf++) {
                for (int e = 0; e < 2; e++) {  /* values l = 16 e .. 16 e + 15 of each quarter */
                    const uint8_t *l = b + 64 * hf + 16 * e;
                    const __m256i la = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)l));
                    const __m256i lb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(l + 32)));
                    const __m256i hv = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 128 + 32 * hf + 16 * e)));
                    const __m256i q[4] = {
                        _mm256_or_si256(_mm256_and_si256(la, f), _mm256_and_si256(_mm256_slli_epi16(hv, 4), t)),
                        _mm256_or_si256(_mm256_and_si256(lb, f), _mm256_and_si256(_mm256_slli_epi16(hv, 2), t)),
                        _mm256_or_si256(_mm256_srli_epi16(la, 4), _mm256_and_si256(hv, t)),
                        _mm256_or_si256(_mm256_srli_epi16(lb, 4), _mm256_and_si256(_mm256_srli_epi16(hv, 2), t))};
                    for (int i = 0; i < 4; i++) {  /* quarter i: values 32 i + 16 e + (0..15), scale 8 hf + 2 i + e */
                        const short s = ((const int8_t *)(b + 192))[8 * hf + 2 * i + e];
                        const __m256i code = _mm256_mullo_epi16(_mm256_sub_epi16(q[i], k32), _mm256_set1_epi16(s));
                        if (i & 1) DOT(ib, code, 128 * hf + 32 * i + 16 * e);
                        else DOT(ia, code, 128 * hf + 32 * i + 16 * e);
                    }
                }
            }
        }
        for (int r = 0; r < rb; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(ia[r], ib[r])),
                                     _mm256_set1_ps(d * dx[r * U + u]), acc[r]);
    }
#undef DOT
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]) + (has_min ? hsum8(macc[r]) : 0.f);
}

static inline __attribute__((always_inline)) void gguf_row(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    if (unit_of(type) == 256) row_k(type, rb, xq, dx, xs, K, row, y, N);
    else row_32(type, rb, xq, dx, xs, K, row, y, N);
}

#define GGUF_DX_ROW(T, K) ((K) / unit_of(T))  /* a step per block of the type */
#define GGUF_XS_ROW(K) ((K) / 32)
GGUF_PRODUCTS

/* gguf_linear's arguments, checked by it. Returns 0, or -1 when out of memory. */
int gguf_avx512(const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t row_bytes,
                int type, int64_t N, float *y, int threads) {
    const int A = unit_of(type);
    int16_t *xq = aligned_alloc(64, (sizeof(int16_t) * R * K + 63) / 64 * 64);
    float *dx = malloc(sizeof(float) * R * (K / A)), *xs = malloc(sizeof(float) * R * (K / 32));
    if (!xq || !dx || !xs) { free(xq); free(dx); free(xs); return -1; }
    quantize(x, R, K, A, xq, dx, xs);
    GGUF_CALL(type, xq, dx, xs, R, K, w, row_bytes, N, y, threads);
    free(xq); free(dx); free(xs);
    return 0;
}
#endif
