/* Few-row products straight from GGUF block bytes: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K
 * and Q6_K, the types of the Q4_K_M / Q5_K_M / Q6_K / Q8_0 files people download.
 *
 * y[r, n] = sum_k x[r, k] * w[n, k] for R rows of float32 activations; each weight row is the
 * file's bytes for that row (K / unit blocks of the type, unit = 32 or 256 values), so a
 * decode step streams exactly as many weight bytes as the file holds (4.5-8.5 bits/weight).
 *
 * A block is decoded once per pass of up to ROW_BLOCK rows into 32-value sub-blocks of
 * int16 codes c with one scale s and one min m each, w_j = s * c_j + m:
 *   Q8_0  c = q (int8)                s = d                    m = 0
 *   Q4_0  c = q - 8                   s = d                    m = 0
 *   Q4_1  c = q                       s = d                    m = m
 *   Q5_0  c = q5 - 16                 s = d                    m = 0
 *   Q5_1  c = q5                      s = d                    m = m
 *   Q4_K  c = q                       s = d * sc (6-bit)       m = -dmin * mn (6-bit)
 *   Q5_K  c = q5                      s = d * sc               m = -dmin * mn
 *   Q6_K  c = q6 - 32                 s = d * sc (an int8 scale per 16 values)     m = 0
 * s and m are exact in float32 (an f16 times an integer below 2^7). The activations are the
 * int16 blocks of quant_rows.h (one scale dx per 32 values), so sum_j c_j xq_j is an exact
 * integer (|c| <= 128, |xq| <= 32767) and
 *
 *   sum_j w_j x_j ~ s * dx * sum_j c_j xq_j + m * sum_j x_j.
 *
 * Q2_K and Q3_K load dense (pagellm/models/gguf_loader.py). Output features are split across
 * OpenMP threads; each output is summed by one thread in a fixed order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gguf_types.h"

#define MAX_UNIT 256

/* IEEE half -> float, subnormals included (scales of tiny weights are subnormal halves). */
static inline float f16(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits |= sign;
    memcpy(&v, &bits, 4);
    return v;
#endif
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4). */
static inline __attribute__((unused)) void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#ifdef __AVX2__
#define XS_PER_BLOCK 1  /* block sums of x: one float per block (deinterleave_rows) */
#else
#define XS_PER_BLOCK 8  /* quantize_rows' eight partial sums per block */
#endif

#ifdef __AVX2__
/* The AVX2 path keeps each 32-value block of activations de-interleaved, even elements then
 * odd ones (xq[0..15] = x0, x2, ..., x30; xq[16..31] = x1, ..., x31): a 16-bit lane of the
 * weight bytes then holds elements 2j and 2j + 1, so codes come out of the bytes with shifts
 * and masks, straight into registers, for every type (no widening pass, no stores). */

/* 16-bit lanes of v: the low byte's / high byte's value, sign-extended. */
static inline __m256i even_i8(__m256i v) { return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8); }
static inline __m256i odd_i8(__m256i v) { return _mm256_srai_epi16(v, 8); }

/* sum_j c_j xq_j over one block as 8 int32 lanes */
static inline __m256i idot_eo(__m256i ev, __m256i od, const int16_t *xq) {
    return _mm256_add_epi32(_mm256_madd_epi16(ev, _mm256_loadu_si256((const __m256i *)xq)),
                            _mm256_madd_epi16(od, _mm256_loadu_si256((const __m256i *)(xq + 16))));
}

/* the same as floats */
static inline __m256 dot_eo(__m256i ev, __m256i od, const int16_t *xq) {
    return _mm256_cvtepi32_ps(idot_eo(ev, od, xq));
}

/* lane i = the sum of all lanes of sub-block i's vector d_i, from h[j] = hadd(hadd(d_4j,
 * d_4j+1), hadd(d_4j+2, d_4j+3)) */
static inline __m256i sum_halves(const __m256i *h) {
    return _mm256_add_epi32(_mm256_permute2x128_si256(h[0], h[1], 0x20), _mm256_permute2x128_si256(h[0], h[1], 0x31));
}

/* Q4_0 / Q4_1 / Q5_* nibble blocks (byte j: element j low, j + 16 high): even, odd codes. */
static inline void nibbles_eo(const uint8_t *qs, __m256i *ev, __m256i *od) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    const __m256i v2 = _mm256_set_m128i(_mm_srli_epi16(v, 4), v), f = _mm256_set1_epi16(0x0F);
    *ev = _mm256_and_si256(v2, f);
    *od = _mm256_and_si256(_mm256_srli_epi16(v2, 8), f);
}

/* Q5_0 / Q5_1: 16 where bit e of qh is set, for the even / odd elements e. */
static inline void high_bits_eo(uint32_t qh, __m256i *ev, __m256i *od) {
    const __m256i h = _mm256_set_m128i(_mm_set1_epi16((short)(qh >> 16)), _mm_set1_epi16((short)(qh & 0xFFFF)));
    const __m256i me = _mm256_setr_epi16(1, 4, 16, 64, 256, 1024, 4096, 16384, 1, 4, 16, 64, 256, 1024, 4096, 16384);
    const __m256i mo = _mm256_slli_epi16(me, 1), sixteen = _mm256_set1_epi16(16);
    *ev = _mm256_or_si256(*ev, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, me), me), sixteen));
    *od = _mm256_or_si256(*od, _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(h, mo), mo), sixteen));
}

/* Rows [0, rb) of one output feature over a weight row of 32-value blocks. */
static inline __attribute__((always_inline)) void row_32(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int64_t G = K / GROUP;
    const int size = bytes_of(type), has_min = type == T_Q4_1 || type == T_Q5_1;
    __m256 acc[ROW_BLOCK];  /* one chain a row, whatever rb is: a row's own bits in any pass */
    float mins[ROW_BLOCK];
    for (int r = 0; r < rb; r++) { acc[r] = _mm256_setzero_ps(); mins[r] = 0.f; }
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *b = row + g * size;
        PREFETCH(b);
        const float d = f16(b), m = has_min ? f16(b + 2) : 0.f;
        __m256i ev, od;
        if (type == T_Q8_0) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 2));
            ev = even_i8(v);
            od = odd_i8(v);
        } else if (type == T_Q4_0 || type == T_Q4_1) {
            nibbles_eo(b + (has_min ? 4 : 2), &ev, &od);
            if (!has_min) { ev = _mm256_sub_epi16(ev, _mm256_set1_epi16(8)); od = _mm256_sub_epi16(od, _mm256_set1_epi16(8)); }
        } else {  /* Q5_0 / Q5_1 */
            uint32_t qh;
            memcpy(&qh, b + (has_min ? 4 : 2), 4);
            nibbles_eo(b + (has_min ? 8 : 6), &ev, &od);
            high_bits_eo(qh, &ev, &od);
            if (!has_min) { ev = _mm256_sub_epi16(ev, _mm256_set1_epi16(16)); od = _mm256_sub_epi16(od, _mm256_set1_epi16(16)); }
        }
        for (int r = 0; r < rb; r++) {
            const __m256 f = dot_eo(ev, od, xq + r * K + g * GROUP);
            acc[r] = _mm256_fmadd_ps(f, _mm256_set1_ps(d * dx[r * G + g]), acc[r]);
            if (has_min) mins[r] = fmaf(m, xs[r * G + g], mins[r]);
        }
    }
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]) + mins[r];
}

/* A K-quant block's 8 sub-block scales s and mins m as floats (Q6_K: s = d, its int8 scales
 * per 16 values are applied with the sums). */
static inline __attribute__((always_inline)) void k_scales(int type, const uint8_t *b, __m256 *sv, __m256 *mv) {
    if (type != T_Q6_K) {
        uint64_t scales, mins;
        k4_scales_mins(b, &scales, &mins);
        *sv = _mm256_mul_ps(_mm256_set1_ps(f16(b)),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales))));
        *mv = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)),
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins))));
    } else {
        *sv = _mm256_set1_ps(f16(b + 208));
        *mv = _mm256_setzero_ps();
    }
}

/* Q4_K / Q5_K: the 4 chunks of 64 values as even / odd codes, sub-block 2c in the low nibbles
 * and 2c + 1 in the high ones; CODE(i, EV, OD) consumes sub-block i. */
#define K4_CODES(type, b, CODE) do { \
        const int five_ = (type) == T_Q5_K; \
        const uint8_t *qs_ = (b) + (five_ ? 48 : 16); \
        const __m256i f_ = _mm256_set1_epi16(0x0F), bit_ = _mm256_set1_epi16(0x10); \
        const __m256i hv_ = five_ ? _mm256_loadu_si256((const __m256i *)((b) + 16)) : _mm256_setzero_si256(); \
        for (int c_ = 0; c_ < 4; c_++) { \
            const __m256i w_ = _mm256_loadu_si256((const __m256i *)(qs_ + 32 * c_)); \
            __m256i ae = _mm256_and_si256(w_, f_), ao = _mm256_and_si256(_mm256_srli_epi16(w_, 8), f_); \
            __m256i be = _mm256_and_si256(_mm256_srli_epi16(w_, 4), f_), bo = _mm256_srli_epi16(w_, 12); \
            if (five_) {  /* bits 2c (sub-block 2c) and 2c + 1 of each element's qh byte */ \
                const __m256i h_ = _mm256_srl_epi16(hv_, _mm_cvtsi32_si128(2 * c_)); \
                ae = _mm256_or_si256(ae, _mm256_and_si256(_mm256_slli_epi16(h_, 4), bit_)); \
                be = _mm256_or_si256(be, _mm256_and_si256(_mm256_slli_epi16(h_, 3), bit_)); \
                ao = _mm256_or_si256(ao, _mm256_and_si256(_mm256_srli_epi16(h_, 4), bit_)); \
                bo = _mm256_or_si256(bo, _mm256_and_si256(_mm256_srli_epi16(h_, 5), bit_)); \
            } \
            CODE(2 * c_, ae, ao); \
            CODE(2 * c_ + 1, be, bo); \
        } } while (0)

/* Q6_K: the 4 sub-blocks of a half (128 values) as bytes q6 = low 4 bits | 2 high bits << 4,
 * from its 64 low-bit bytes (la, lb) and 32 high-bit bytes (hv). The epi16 shifts move bits
 * inside each byte here: the masks drop what crosses. */
#define Q6_CODES(la, lb, hv, f, t) { \
    _mm256_or_si256(_mm256_and_si256(la, f), _mm256_and_si256(_mm256_slli_epi16(hv, 4), t)), \
    _mm256_or_si256(_mm256_and_si256(lb, f), _mm256_and_si256(_mm256_slli_epi16(hv, 2), t)), \
    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), f), _mm256_and_si256(hv, t)), \
    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), f), _mm256_and_si256(_mm256_srli_epi16(hv, 2), t))}

/* Q4_K / Q5_K, one block of one row: sums [8] int32 (lane i: sub-block i's exact integer sum)
 * times s * dx, and the min terms. */
static inline __attribute__((always_inline)) void k4_finish(__m256i sums, __m256 sv, __m256 mv,
                                                            const float *dx, const float *xs,
                                                            __m256 *acc, __m256 *macc) {
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(sv, _mm256_loadu_ps(dx)), *acc);
    *macc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs), *macc);
}

/* Q6_K, one half of 128 values of one row: sums [8] int32 (sum_halves' h[j] order: the exact
 * 16-value sums of sub-blocks 0-3's first halves, then of their second halves), each times
 * its int8 scale (sc8, the same order) and s * dx. */
static inline __attribute__((always_inline)) void q6_finish(__m256i sums, __m256 sc8, __m256 sv,
                                                            const float *dx, __m256 *acc) {
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                           _mm256_mul_ps(_mm256_mul_ps(sc8, sv), _mm256_broadcast_ps((const __m128 *)dx)), *acc);
}

/* A Q6_K half's 8 int8 scales as floats in q6_finish's order (sub-blocks 0-3's first
 * halves, then their second halves). */
static inline __m256 q6_scales(const uint8_t *b, int h) {
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(
        _mm_loadl_epi64((const __m128i *)(b + 192 + 8 * h)), order)));
}

/* Rows [0, rb) of one output feature over a weight row of 256-value K-quant blocks. Each
 * block's codes are made once and their integer sums taken for every row: sub-blocks' int32
 * lanes are added pairwise as they come (hadd: exact, so in any order), and
 * each row scales its exact sub-block sums once per block (k4_finish, q6_finish). One
 * arithmetic for every rb: a row's outputs have the same bits in any pass, so greedy output
 * with speculation or beside other requests is the request's own. */
static inline __attribute__((always_inline)) void row_k(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int64_t G = K / GROUP;
    const int size = bytes_of(type), has_min = type != T_Q6_K;
    __m256 acc[ROW_BLOCK], macc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = _mm256_setzero_ps(); }
    /* per row: sub-block 4j's lanes, hadd of sub-blocks (4j, 4j + 1), and per 4 sub-blocks
     * half[j] = hadd of those two pairs (lanes: the 4 sums of each 128-bit half) */
    __m256i even[ROW_BLOCK], pair[ROW_BLOCK], half[ROW_BLOCK][2];
#define DOT(i, EV, OD) do { \
        const __m256i ev_ = (EV), od_ = (OD); \
        for (int r = 0; r < rb; r++) { \
            const __m256i d_ = idot_eo(ev_, od_, xq + r * K + (g0 + (i)) * GROUP); \
            if ((i) % 2 == 0) even[r] = d_; \
            else if ((i) % 4 == 1) pair[r] = _mm256_hadd_epi32(even[r], d_); \
            else half[r][((i) / 4) % 2] = _mm256_hadd_epi32(pair[r], _mm256_hadd_epi32(even[r], d_)); \
        } } while (0)
    for (int64_t u = 0; u < K / 256; u++) {
        const uint8_t *b = row + u * size;
        PREFETCH_BLOCK(b, size);
        const int64_t g0 = u * 8;
        __m256 sv, mv;
        k_scales(type, b, &sv, &mv);
        if (has_min) {
            K4_CODES(type, b, DOT);
            for (int r = 0; r < rb; r++)
                k4_finish(sum_halves(half[r]), sv, mv, dx + r * G + g0, xs + r * G + g0, &acc[r], &macc[r]);
            continue;
        }
        /* Q6_K: two halves of 128 values, four sub-blocks each */
        const __m256i f = _mm256_set1_epi8(0x0F), t = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l = b + 64 * h;
            const __m256i la = _mm256_loadu_si256((const __m256i *)l);
            const __m256i lb = _mm256_loadu_si256((const __m256i *)(l + 32));
            const __m256i hv = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i q[4] = Q6_CODES(la, lb, hv, f, t);
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_sub_epi8(q[i], k32);
                DOT(4 * h + i, even_i8(v), odd_i8(v));
            }
            const __m256 sc8 = q6_scales(b, h);
            for (int r = 0; r < rb; r++) q6_finish(half[r][h], sc8, sv, dx + r * G + g0 + 4 * h, &acc[r]);
        }
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

/* quantize_rows' output -> the AVX2 layout: each block's int16 values de-interleaved (even
 * elements, then odd) and its 8 partial sums added up (xs [R, G] block sums). */
static void deinterleave_rows(int16_t *xq, const float *xs8, float *xs, int64_t blocks) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t b = 0; b < blocks; b++) {
        __m256i *p = (__m256i *)(xq + b * GROUP);
        /* per 128-bit lane: 4 even values, then 4 odd; then gather evens of both halves */
        const __m256i h0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256(p), pick), 0xD8);
        const __m256i h1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256(p + 1), pick), 0xD8);
        _mm256_storeu_si256(p, _mm256_permute2x128_si256(h0, h1, 0x20));
        _mm256_storeu_si256(p + 1, _mm256_permute2x128_si256(h0, h1, 0x31));
        xs[b] = hsum8(_mm256_loadu_ps(xs8 + b * 8));
    }
}
#else
/* One block at b -> c [unit] int16, s, m [unit / 32]. Returns whether m may be nonzero. */
static inline __attribute__((always_inline)) int decode(int type, const uint8_t *b, int16_t *c,
                                                        float *s, float *m) {
    switch (type) {
    case T_Q8_0:
        s[0] = f16(b);
        for (int j = 0; j < 32; j++) c[j] = (int8_t)b[2 + j];
        return 0;
    case T_Q4_0: case T_Q4_1: {
        const int has_min = type == T_Q4_1;
        const uint8_t *qs = b + (has_min ? 4 : 2);
        s[0] = f16(b);
        m[0] = has_min ? f16(b + 2) : 0.f;
        for (int j = 0; j < 16; j++) {
            c[j] = (int16_t)((qs[j] & 15) - (has_min ? 0 : 8));
            c[j + 16] = (int16_t)((qs[j] >> 4) - (has_min ? 0 : 8));
        }
        return has_min;
    }
    case T_Q5_0: case T_Q5_1: {
        const int has_min = type == T_Q5_1;
        const uint8_t *qh = b + (has_min ? 4 : 2), *qs = qh + 4;
        uint32_t high;
        memcpy(&high, qh, 4);
        s[0] = f16(b);
        m[0] = has_min ? f16(b + 2) : 0.f;
        for (int j = 0; j < 16; j++) {
            c[j] = (int16_t)(((qs[j] & 15) | (((high >> j) & 1) << 4)) - (has_min ? 0 : 16));
            c[j + 16] = (int16_t)(((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) - (has_min ? 0 : 16));
        }
        return has_min;
    }
    case T_Q4_K: case T_Q5_K: {
        const int five = type == T_Q5_K;
        const float d = f16(b), dmin = f16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            scale_min_k4(j, scales, &sc, &mn);
            s[j] = d * (float)sc;
            m[j] = -dmin * (float)mn;
        }
        for (int ch = 0; ch < 4; ch++)
            for (int j = 0; j < 32; j++) {
                const uint8_t q = qs[32 * ch + j];
                c[64 * ch + j] = (int16_t)((q & 15) + (five && (qh[j] >> (2 * ch) & 1) ? 16 : 0));
                c[64 * ch + 32 + j] = (int16_t)((q >> 4) + (five && (qh[j] >> (2 * ch + 1) & 1) ? 16 : 0));
            }
        return 1;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16(b + 208);
        for (int j = 0; j < 8; j++) s[j] = d;
        for (int h = 0; h < 2; h++) {  /* 128 values: four 32-value sub-blocks */
            const uint8_t *l = ql + 64 * h, *hh = qh + 32 * h;
            const int8_t *sch = sc + 8 * h;
            int16_t *ch = c + 128 * h;
            for (int j = 0; j < 32; j++) {
                const int is = j / 16;
                ch[j] = (int16_t)((((l[j] & 15) | ((hh[j] & 3) << 4)) - 32) * sch[is]);
                ch[j + 32] = (int16_t)((((l[j + 32] & 15) | (((hh[j] >> 2) & 3) << 4)) - 32) * sch[is + 2]);
                ch[j + 64] = (int16_t)((((l[j] >> 4) | (((hh[j] >> 4) & 3) << 4)) - 32) * sch[is + 4]);
                ch[j + 96] = (int16_t)((((l[j + 32] >> 4) | (((hh[j] >> 6) & 3) << 4)) - 32) * sch[is + 6]);
            }
        }
        return 0;
    }
    }
    return 0;
}

/* Rows [0, rb) of output feature n: acc over the weight row's blocks. xq, dx, xs8 point at
 * the pass's first row (quant_rows.h layout). */
static inline __attribute__((always_inline)) void gguf_row(
        int type, int rb, const int16_t *xq, const float *dx, const float *xs8, int64_t K,
        const uint8_t *row, float *y, int64_t N) {
    const int unit = unit_of(type), sub = unit / GROUP, size = bytes_of(type);
    const int64_t G = K / GROUP;
    int16_t c[MAX_UNIT] __attribute__((aligned(32)));
    float s[MAX_UNIT / GROUP], m[MAX_UNIT / GROUP];
    float acc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) acc[r] = 0.f;
    for (int64_t u = 0; u < K / unit; u++) {
        const int has_min = decode(type, row + u * size, c, s, m);
        for (int i = 0; i < sub; i++) {
            const int64_t g = u * sub + i;
            const int16_t *ci = c + GROUP * i;
            for (int r = 0; r < rb; r++) {
                const int16_t *xr = xq + r * K + g * GROUP;
                int32_t t = 0;
                float xs = 0.f;
                for (int j = 0; j < GROUP; j++) t += (int32_t)ci[j] * xr[j];
                for (int j = 0; j < 8; j++) xs += xs8[(r * G + g) * 8 + j];
                acc[r] += (float)t * (s[i] * dx[r * G + g]) + (has_min ? m[i] * xs : 0.f);
            }
        }
    }
    for (int r = 0; r < rb; r++) y[r * N] = acc[r];
}
#endif

#define GGUF_DX_ROW(T, K) ((K) / GROUP)  /* a step per 32 values */
#define GGUF_XS_ROW(K) ((K) / GROUP * XS_PER_BLOCK)
GGUF_PRODUCTS

/* x [R, K] float32, w [N, row_bytes] (each row K / unit blocks of `type`, as in the file)
 * -> y [R, N]. Returns 0; -1 when out of memory; -2 for a type or width it does not take. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__)
#define GGUF_AVX512 1
int gguf_avx512(const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t row_bytes,
                int type, int64_t N, float *y, int threads);
#else
#define GGUF_AVX512 0
#endif

/* Whether products take the AVX-512 path (built so, and not turned off by
 * PAGELLM_GGUF_AVX512=0, for comparisons). */
static int use_avx512(void) {
    static int use = -1;
    if (use < 0) {
        const char *e = getenv("PAGELLM_GGUF_AVX512");
        use = GGUF_AVX512 && !(e && e[0] == '0');
    }
    return use;
}

/* How many activations share one int16 step in this build's product for `type` and R rows:
 * 32, or a K-quant's 256 on the AVX-512 path (cpu_gguf_avx512.c). That path takes every row
 * count now that weights are prefetched to L2 (a 1.5B's Q4_K / Q6_K layers streamed at one
 * row: 48.5 -> 43.7 ms against the AVX2 path; five rows: 80 -> 73 ms). */
int gguf_act_group(int type, int64_t R) { (void)R; return use_avx512() ? unit_of(type) : GROUP; }

int gguf_linear(const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t row_bytes,
                int type, int64_t N, float *y, int threads) {
    if (!bytes_of(type) || K % unit_of(type) || row_bytes != K / unit_of(type) * bytes_of(type))
        return -2;
    if (R == 0) return 0;  /* (a prefill chunk with no logits; the K-quant passes divide by R) */
#if GGUF_AVX512
    if (use_avx512()) return gguf_avx512(x, R, K, w, row_bytes, type, N, y, threads);
#endif
    const int64_t G = K / GROUP;
    int16_t *xq = malloc(sizeof(int16_t) * R * K);
    float *dx = malloc(sizeof(float) * R * G), *xs8 = malloc(sizeof(float) * R * G * 8);
    if (!xq || !dx || !xs8) { free(xq); free(dx); free(xs8); return -1; }
    quantize_rows(x, R, K, xq, dx, xs8);
#ifdef __AVX2__
    float *xs = xs8;  /* block sums written over the partial sums (each read before) */
    deinterleave_rows(xq, xs8, xs, R * G);
#else
    const float *xs = xs8;
#endif
    GGUF_CALL(type, xq, dx, xs, R, K, w, row_bytes, N, y, threads);
    free(xq); free(dx); free(xs8);
    return 0;
}
