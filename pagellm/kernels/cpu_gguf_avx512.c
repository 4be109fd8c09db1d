/* Few-row GGUF products on CPUs with AVX-512 BW and VNNI (cpu_gguf.c calls gguf_avx512 there;
 * elsewhere this file compiles to nothing). Same contract as gguf_linear: y [R, N] = x [R, K]
 * times the file's blocks, exact integer block sums, each output summed by one thread.
 *
 * What differs from the AVX2 path, and why it is faster per byte of weight:
 * - int16 codes in the file's natural order (vpmovzxbw of the bytes, a nibble mask or shift;
 *   Q5's fifth bits are a mask register for one masked add), so activations need no
 *   de-interleaving; a 32-value block fills a 256-bit register, a K-quant sub-block a 512-bit
 *   one;
 * - vpdpwssd multiplies and accumulates int16 pairs into int32 lanes in one instruction;
 * - K-quants: activations get one int16 scale per 256-value super-block (not per 32), so each
 *   code is multiplied by its integer sub-block scale once (vpmullw, shared by every row) and a
 *   row's whole super-block sums in int32 lanes, then one convert and one FMA per block and row
 *   (the AVX2 path sums each 32-value sub-block of every row across its lanes, then scales the
 *   8 sums). int16 steps of
 *   max|x| / 32767 over 256 values are still 256x finer than int8 steps over 32.
 *
 * Integer ranges (no lane can overflow): Q4_K / Q5_K codes c <= 31 times scales <= 63 give
 * <= 1953; Q6_K (q - 32) in [-32, 31] times int8 scales gives |.| <= 4096; |xq| <= 32767; a
 * lane sums at most 16 products of a super-block: <= 16 * 4096 * 32767 < 2^31. 32-value types:
 * a fresh int32 sum per block.
 */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gguf_types.h"
#include "vec_math.h"

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* x [R, K] -> xq [R, K] int16 (x / step rounded to nearest, ties to even), dx [R, K / A] the
 * steps (max|x| of each A values / 32767), xs [R, K / 32] float sums of 32 values (min terms). */
static void quantize(const float *x, int64_t R, int64_t K, int A, int16_t *xq, float *dx, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t a = 0; a < R * K / A; a++) {
        const float *xa = x + a * A;
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < A; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xa + j)));
        const float mx = hmax8(m);
        const __m256 inv = _mm256_set1_ps(code_factor(32767.f, mx));
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

/* The sum of 16 float lanes (lo: lanes 0-7, hi: 8-15) in one fixed order, shared by both
 * 32-value kernels below. */
static inline float sum16(__m256 lo, __m256 hi) { return hsum8(_mm256_add_ps(lo, hi)); }
static inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* Rows [0, rb) of one output feature over a weight row of 32-value blocks, for one or two
 * rows: row_32_wide's arithmetic to the bit (each block's 16 int32 pair sums converted and
 * times d * dx into 16 lanes, lane by lane; the min terms m * xs into lane g % 16; the lanes
 * summed by sum16), in 256-bit halves and with each block's scale set on its own, where
 * row_32_wide's chunk set-up and 512-bit operations cost one row more (1-row products of
 * Q8_0 / Q5_0 1.15x / 1.4x slower there). So a row's outputs have the same bits in any pass. */
static inline __attribute__((always_inline)) void row_32_narrow(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int64_t G = K / 32;
    const int size = bytes_of(type), has_min = type == T_Q4_1 || type == T_Q5_1;
    __m256 lo[2], hi[2];
    float mins[2][16];
    for (int r = 0; r < rb; r++) {
        lo[r] = hi[r] = _mm256_setzero_ps();
        for (int j = 0; j < 16; j++) mins[r][j] = 0.f;
    }
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
            const __m256 sc = _mm256_set1_ps(d * dx[r * G + g]);
            const __m256i t0 = _mm256_dpwssd_epi32(_mm256_setzero_si256(), c0, _mm256_loadu_si256((const __m256i *)xr));
            const __m256i t1 = _mm256_dpwssd_epi32(_mm256_setzero_si256(), c1, _mm256_loadu_si256((const __m256i *)(xr + 16)));
            lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t0), sc, lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t1), sc, hi[r]);
            if (has_min) mins[r][g & 15] = fmaf(m, xs[r * G + g], mins[r][g & 15]);
        }
    }
    for (int r = 0; r < rb; r++)
        y[r * N] = sum16(lo[r], hi[r]) + (has_min ? sum16(_mm256_loadu_ps(mins[r]), _mm256_loadu_ps(mins[r] + 8)) : 0.f);
}

/* Rows [0, rb) of one output feature over a weight row of 32-value blocks. A chunk of up to 16
 * blocks first gets its scale products d * dx (one 512-bit multiply a row) and its min terms
 * m * xs (one FMA a row) in vectors; then each block's 32 codes fill one 512-bit register (the
 * 16 bytes broadcast to both halves, shifted by 0 or 4: values 0-31 in order, Q5's fifth bits
 * one masked add) for one vpdpwssd, one convert and one FMA per row. Per block and row that is
 * 3 vector instructions, where a block scaled on its own (two f16 conversions, a scalar
 * multiply and broadcast, a scalar min term) took ~9: one row of a 0.5B's Q4_1 / Q5_0
 * projections was compute-bound, not memory-bound. Three rows or more (one chain a row). */
#define CHUNK32 16
static inline __attribute__((always_inline)) void row_32_wide(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int64_t G = K / 32;
    const int size = bytes_of(type), has_min = type == T_Q4_1 || type == T_Q5_1;
    const int five = type == T_Q5_0 || type == T_Q5_1;
    __m512 acc[ROW_BLOCK], macc[ROW_BLOCK], sc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) { acc[r] = _mm512_setzero_ps(); macc[r] = _mm512_setzero_ps(); }
    /* int16 lanes 0-15: the low nibbles (values 0-15), lanes 16-31: the high ones (16-31) */
    const long long four = 0x0004000400040004LL;
    const __m512i shift = _mm512_set_epi64(four, four, four, four, 0, 0, 0, 0);
    const __m512i fifteen = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
    const __m512i off = _mm512_set1_epi16(five ? 16 : 8);
    for (int64_t g0 = 0; g0 < G; g0 += CHUNK32) {
        const int n = G - g0 < CHUNK32 ? (int)(G - g0) : CHUNK32;
        const __mmask16 live = (__mmask16)((1u << n) - 1);
        /* each block's first 4 bytes: d (f16), then m where it has one */
        const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(size)),
            row + g0 * size, 1);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        for (int r = 0; r < rb; r++)
            sc[r] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, dx + r * G + g0));
        if (has_min) {
            const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
            for (int r = 0; r < rb; r++)
                macc[r] = _mm512_mask3_fmadd_ps(m, _mm512_maskz_loadu_ps(live, xs + r * G + g0), macc[r], live);
        }
        for (int j = 0; j < n; j++) {
            const uint8_t *b = row + (g0 + j) * size;
            PREFETCH(b);
            __m512i c;  /* values 0-31 */
            if (type == T_Q8_0) {
                c = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2)));
            } else {
                const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * has_min + 4 * five));
                c = _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(q)), shift), fifteen);
                if (five) {  /* bit j of qh: 16 more for value j */
                    uint32_t qh;
                    memcpy(&qh, b + 2 + 2 * has_min, 4);
                    c = _mm512_mask_add_epi16(c, (__mmask32)qh, c, sixteen);
                }
                if (!has_min) c = _mm512_sub_epi16(c, off);
            }
            for (int r = 0; r < rb; r++) {
                const __m512i t = _mm512_dpwssd_epi32(_mm512_setzero_si512(), c,
                                                      _mm512_loadu_si512(xq + r * K + (g0 + j) * 32));
                const __m512 s = _mm512_permutexvar_ps(_mm512_set1_epi32(j), sc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[r]);
            }
        }
    }
    for (int r = 0; r < rb; r++)
        y[r * N] = sum16(_mm512_castps512_ps256(acc[r]), high8(acc[r])) +
                   (has_min ? sum16(_mm512_castps512_ps256(macc[r]), high8(macc[r])) : 0.f);
}
#undef CHUNK32

static inline __attribute__((always_inline)) void row_32(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    if (rb <= 2) row_32_narrow(type, rb, xq, dx, xs, K, row, y, N);  /* rb: a constant here */
    else row_32_wide(type, rb, xq, dx, xs, K, row, y, N);
}

/* Rows [0, rb) of one output feature over blocks [u0, u1) of a weight row of 256-value K-quant
 * blocks (dx: one step per 256 values), added to y unless u0 is 0; weights prefetched pf bytes
 * ahead. Each block's codes, times their integer sub-block scales, are made once and
 * multiplied into every row's int32 sums. 512-bit registers hold a sub-block's 32 codes, so a
 * block is 8 vpdpwssd per row (16 with 256-bit ones: 5-row products 9% slower); chains per
 * row: 4 for one row (a dot's latency would otherwise serialise a block's 8), 2 for more rows
 * (the rows interleave). */
static inline __attribute__((always_inline)) void row_k_chunk(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        int64_t u0, int64_t u1, int64_t pf, const uint8_t *row, float *y, int64_t N) {
    const int64_t U = K / 256, G = K / 32;
    const int size = bytes_of(type), has_min = type != T_Q6_K, NC = rb == 1 ? 4 : 2;
    __m512 acc[ROW_BLOCK];
    __m256 macc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) { acc[r] = _mm512_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
#define DOT512(CODE, J, OFFSET) \
    for (int r = 0; r < rb; r++) \
        ia[r * NC + (J) % NC] = _mm512_dpwssd_epi32(ia[r * NC + (J) % NC], CODE, _mm512_loadu_si512(xb + r * K + (OFFSET)))
    for (int64_t u = u0; u < u1; u++) {
        const uint8_t *b = row + u * size;
        for (int i = 0; i < size; i += 64) _mm_prefetch((const char *)b + pf + i, PF_HINT);
        const int16_t *xb = xq + u * 256;
        __m512i ia[ROW_BLOCK * 2];  /* rb * NC chains: 4 at one row, 2 a row past it */
        for (int r = 0; r < rb * NC; r++) ia[r] = _mm512_setzero_si512();
        float d;
        if (has_min) {  /* Q4_K / Q5_K */
            d = f16(b);
            uint64_t scales, mins;
            k4_scales_mins(b, &scales, &mins);
            const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)),
                                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins))));
            for (int r = 0; r < rb; r++)
                macc[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + r * G + u * 8), macc[r]);
            const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)scales)));
            const int five = type == T_Q5_K;
            const uint8_t *qs = b + (five ? 48 : 16);
            const __m512i f = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
            const __m512i hb = five ? _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 16))) : f;
            for (int c = 0; c < 4; c++) {
                /* sub-blocks 2c (low nibbles) and 2c + 1 (high) of 32 bytes */
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
                __m512i lo = _mm512_and_si512(v, f), hi = _mm512_srli_epi16(v, 4);
                if (five) {
                    lo = _mm512_mask_add_epi16(lo, _mm512_test_epi16_mask(hb, _mm512_set1_epi16((short)(1 << (2 * c)))), lo, sixteen);
                    hi = _mm512_mask_add_epi16(hi, _mm512_test_epi16_mask(hb, _mm512_set1_epi16((short)(2 << (2 * c)))), hi, sixteen);
                }
                lo = _mm512_mullo_epi16(lo, _mm512_permutexvar_epi16(_mm512_set1_epi16((short)(2 * c)), s16));
                hi = _mm512_mullo_epi16(hi, _mm512_permutexvar_epi16(_mm512_set1_epi16((short)(2 * c + 1)), s16));
                DOT512(lo, 2 * c, 64 * c);
                DOT512(hi, 2 * c + 1, 64 * c + 32);
            }
        } else {  /* Q6_K: per half of 128 values, 4 quarters of 32 codes, an int8 scale per 16 */
            d = f16(b + 208);
            const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
            const __m512i f = _mm512_set1_epi16(15), t = _mm512_set1_epi16(0x30), k32 = _mm512_set1_epi16(32);
            const long long o = 0x0001000100010001LL;  /* int16 lanes 16-31: +1 (their second scale) */
            const __m512i one16 = _mm512_set_epi64(o, o, o, o, 0, 0, 0, 0);
            for (int hf = 0; hf < 2; hf++) {
                const uint8_t *l = b + 64 * hf;
                const __m512i la = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)l));
                const __m512i lb = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(l + 32)));
                const __m512i hv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * hf)));
                const __m512i q[4] = {
                    _mm512_or_si512(_mm512_and_si512(la, f), _mm512_and_si512(_mm512_slli_epi16(hv, 4), t)),
                    _mm512_or_si512(_mm512_and_si512(lb, f), _mm512_and_si512(_mm512_slli_epi16(hv, 2), t)),
                    _mm512_or_si512(_mm512_srli_epi16(la, 4), _mm512_and_si512(hv, t)),
                    _mm512_or_si512(_mm512_srli_epi16(lb, 4), _mm512_and_si512(_mm512_srli_epi16(hv, 2), t))};
                for (int i = 0; i < 4; i++) {  /* quarter i: values 32 i + (0..31), scales 8 hf + 2 i (+1) */
                    const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(8 * hf + 2 * i)), one16);
                    const __m512i code = _mm512_mullo_epi16(_mm512_sub_epi16(q[i], k32), _mm512_permutexvar_epi16(idx, sc16));
                    DOT512(code, 4 * hf + i, 128 * hf + 32 * i);
                }
            }
        }
        for (int r = 0; r < rb; r++) {
            __m512i s = ia[r * NC];
            for (int j = 1; j < NC; j++) s = _mm512_add_epi32(s, ia[r * NC + j]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * dx[r * U + u]), acc[r]);
        }
    }
#undef DOT512
    for (int r = 0; r < rb; r++)
        y[r * N] = (u0 ? y[r * N] : 0.f) + _mm512_reduce_add_ps(acc[r]) + (has_min ? hsum8(macc[r]) : 0.f);
}

/* A pass over K in chunks of K_CHUNK_BLOCKS takes one chunk of every output at a
 * time; a pass over the whole K takes every chunk of one output. Both sum each output chunk
 * by chunk, in order, so that a row's outputs have the same bits whichever pass takes it:
 * otherwise the 1.5B's down projections differed between 1 row and 3 (1,216 of 1,536
 * outputs in their last bits), and greedy output with speculation or in a batch of 3+
 * drifted from the same request alone. */
#define K_CHUNK_BLOCKS 8
static inline __attribute__((always_inline)) void row_k(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        int64_t u0, int64_t u1, int64_t pf, const uint8_t *row, float *y, int64_t N) {
    for (int64_t c0 = u0, c1; c0 < u1; c0 = c1) {
        c1 = (c0 / K_CHUNK_BLOCKS + 1) * K_CHUNK_BLOCKS;
        row_k_chunk(type, rb, xq, dx, xs, K, c0, c1 < u1 ? c1 : u1, pf, row, y, N);
    }
}

/* 32-value types: GGUF_PRODUCT's passes through row_32. */
#define gguf_row row_32
#define GGUF_DX_ROW(T, K) ((K) / 32)
#define GGUF_XS_ROW(K) ((K) / 32)
GGUF_PRODUCTS_32
#undef gguf_row

/* K-quants: a pass re-reads its rows' int16 activations for every output, and they stay in L1
 * beside the streaming weights only up to ~40 KiB. Past that (a 1.5B's 8,960-input down
 * projection: 17.5 KiB a row, from 3 rows) the passes take K in chunks of 8 blocks (4 KiB a
 * row; 16 blocks were 1.2x slower at 8 rows), every output's chunk before the next chunk (5
 * rows: the 1.5B's Q6_K down projections 1.5x faster). Each output sums its chunks in order,
 * by the thread that owns it in every chunk: the same sums however many threads. Passes take
 * at most 7 rows: 8 rows' accumulators spill out of the 32 vector registers (one pass of 8
 * rows 1.4x slower than 4 + 4). */
#define L1_WHOLE_K 40960
#define K_PASS_ROWS 7
#define ROWS_K(T, RB) row_k(T, RB, xq + r0 * K, dx + r0 * (K / 256), xs + r0 * (K / 32), K, u0, u1, \
                            pf, w + n * row_bytes, y + r0 * N + n, N)
#define ROWS_K_T_Q4_K(RB) ROWS_K(T_Q4_K, RB)
#define ROWS_K_T_Q5_K(RB) ROWS_K(T_Q5_K, RB)
#define ROWS_K_T_Q6_K(RB) ROWS_K(T_Q6_K, RB)
#define GGUF_PRODUCT_K(T) \
static void product_##T(const int16_t *xq, const float *dx, const float *xs, int64_t R, int64_t K, \
                        const uint8_t *w, int64_t row_bytes, int64_t N, float *y, int threads) { \
    const int64_t U = K / 256, passes = (R + K_PASS_ROWS - 1) / K_PASS_ROWS; \
    const int64_t rows = (R + passes - 1) / passes; /* the largest pass */ \
    const int64_t cb = rows * K * 2 <= L1_WHOLE_K ? U : K_CHUNK_BLOCKS; \
    /* prefetch ~PF_DIST ahead: in the row, or in the rows after it when a pass takes a chunk */ \
    const int64_t chunk = cb * bytes_of(T); \
    const int64_t pf = cb >= U ? PF_DIST : (PF_DIST + chunk - 1) / chunk * row_bytes; \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)") \
    for (int64_t u0 = 0; u0 < U; u0 += cb) { \
        const int64_t u1 = u0 + cb < U ? u0 + cb : U; \
        /* the same static split of the outputs in every chunk: a thread adds to its own */ \
        _Pragma("omp for schedule(static) nowait") \
        for (int64_t n = 0; n < N; n++) \
            for (int64_t p = 0, r0 = 0, rb; p < passes; p++, r0 += rb) { \
                rb = R / passes + (p < R % passes); \
                DISPATCH(rb, ROWS_K_##T) \
            } \
    } \
}
GGUF_PRODUCT_K(T_Q4_K)
GGUF_PRODUCT_K(T_Q5_K)
GGUF_PRODUCT_K(T_Q6_K)

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
