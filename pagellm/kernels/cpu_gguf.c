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
 *   Q6_K  c = (q6 - 32) * sc (int8 scale per 16 values, folded into the codes)   s = d   m = 0
 * s and m are exact in float32 (an f16 times an integer below 2^7). The activations are the
 * int16 blocks of quant_rows.h (one scale dx per 32 values), so sum_j c_j xq_j is an exact
 * integer (|c| <= 4096, |xq| <= 32767: four products per int32 lane stay below 2^31) and
 *
 *   sum_j w_j x_j ~ s * dx * sum_j c_j xq_j + m * sum_j x_j.
 *
 * Q2_K and Q3_K load dense (pagellm/models/gguf_loader.py). Output features are split across
 * OpenMP threads; each output is summed by one thread in a fixed order.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "quant_rows.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13,
       T_Q6_K = 14 };
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
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static inline int unit_of(int type) { return type >= T_Q4_K ? 256 : 32; }

static inline int bytes_of(int type) {
    switch (type) {
    case T_Q4_0: return 18; case T_Q4_1: return 20; case T_Q5_0: return 22;
    case T_Q5_1: return 24; case T_Q8_0: return 34; case T_Q4_K: return 144;
    case T_Q5_K: return 176; case T_Q6_K: return 210; default: return 0;
    }
}

#ifdef __AVX2__
/* 16 bytes -> 16 int16 (unsigned / signed) stored at c. */
static inline void widen_u8(__m128i v, int16_t *c) { _mm256_storeu_si256((__m256i *)c, _mm256_cvtepu8_epi16(v)); }
static inline void widen_i8(__m128i v, int16_t *c) { _mm256_storeu_si256((__m256i *)c, _mm256_cvtepi8_epi16(v)); }
/* 32 bytes -> 32 int16 at c. */
static inline void widen32_u8(__m256i v, int16_t *c) {
    widen_u8(_mm256_castsi256_si128(v), c);
    widen_u8(_mm256_extracti128_si256(v, 1), c + 16);
}
/* bits of a 32-bit mask as bytes: 0xFF where bit j is set, byte j = element j. */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i shuffle = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                               0x0202020202020202, 0x0303030303030303);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
/* Q4_0 / Q4_1 / Q5_* nibbles: byte j holds element j (low) and j + 16 (high). */
static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
#endif

/* One block at b -> c [unit] int16, s, m [unit / 32]. Returns whether m may be nonzero. */
static inline __attribute__((always_inline)) int decode(int type, const uint8_t *b, int16_t *c,
                                                        float *s, float *m) {
    switch (type) {
    case T_Q8_0:
        s[0] = f16(b);
#ifdef __AVX2__
        widen_i8(_mm_loadu_si128((const __m128i *)(b + 2)), c);
        widen_i8(_mm_loadu_si128((const __m128i *)(b + 18)), c + 16);
#else
        for (int j = 0; j < 32; j++) c[j] = (int8_t)b[2 + j];
#endif
        return 0;
    case T_Q4_0: case T_Q4_1: {
        const int has_min = type == T_Q4_1;
        const uint8_t *qs = b + (has_min ? 4 : 2);
        s[0] = f16(b);
        m[0] = has_min ? f16(b + 2) : 0.f;
#ifdef __AVX2__
        __m256i v = nibbles32(qs);
        if (!has_min) v = _mm256_sub_epi8(v, _mm256_set1_epi8(8));
        widen_i8(_mm256_castsi256_si128(v), c);
        widen_i8(_mm256_extracti128_si256(v, 1), c + 16);
#else
        for (int j = 0; j < 16; j++) {
            c[j] = (int16_t)((qs[j] & 15) - (has_min ? 0 : 8));
            c[j + 16] = (int16_t)((qs[j] >> 4) - (has_min ? 0 : 8));
        }
#endif
        return has_min;
    }
    case T_Q5_0: case T_Q5_1: {
        const int has_min = type == T_Q5_1;
        const uint8_t *qh = b + (has_min ? 4 : 2), *qs = qh + 4;
        uint32_t high;
        memcpy(&high, qh, 4);
        s[0] = f16(b);
        m[0] = has_min ? f16(b + 2) : 0.f;
#ifdef __AVX2__
        __m256i v = _mm256_or_si256(nibbles32(qs),
                                    _mm256_and_si256(bits_to_bytes(high), _mm256_set1_epi8(16)));
        if (!has_min) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
        widen_i8(_mm256_castsi256_si128(v), c);
        widen_i8(_mm256_extracti128_si256(v, 1), c + 16);
#else
        for (int j = 0; j < 16; j++) {
            c[j] = (int16_t)(((qs[j] & 15) | (((high >> j) & 1) << 4)) - (has_min ? 0 : 16));
            c[j + 16] = (int16_t)(((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) - (has_min ? 0 : 16));
        }
#endif
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
#ifdef __AVX2__
        const __m256i low = _mm256_set1_epi8(0x0F);
        const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        for (int ch = 0; ch < 4; ch++) {  /* 64 values: low nibbles, then high nibbles */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * ch));
            __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            if (five) {
                const __m256i b1 = _mm256_set1_epi8((char)(1 << (2 * ch))), b2 = _mm256_set1_epi8((char)(2 << (2 * ch)));
                const __m256i sixteen = _mm256_set1_epi8(16);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, b1), b1), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, b2), b2), sixteen));
            }
            widen32_u8(lo, c + 64 * ch);
            widen32_u8(hi, c + 64 * ch + 32);
        }
#else
        for (int ch = 0; ch < 4; ch++)
            for (int j = 0; j < 32; j++) {
                const uint8_t q = qs[32 * ch + j];
                c[64 * ch + j] = (int16_t)((q & 15) + (five && (qh[j] >> (2 * ch) & 1) ? 16 : 0));
                c[64 * ch + 32 + j] = (int16_t)((q >> 4) + (five && (qh[j] >> (2 * ch + 1) & 1) ? 16 : 0));
            }
#endif
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
#ifdef __AVX2__
            const __m256i la = _mm256_loadu_si256((const __m256i *)l);
            const __m256i lb = _mm256_loadu_si256((const __m256i *)(l + 32));
            const __m256i hv = _mm256_loadu_si256((const __m256i *)hh);
            const __m256i f = _mm256_set1_epi8(0x0F), t = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
            /* epi16 shifts move bits inside each byte here: the masks drop what crosses */
            __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(la, f), _mm256_and_si256(_mm256_slli_epi16(hv, 4), t)),
                _mm256_or_si256(_mm256_and_si256(lb, f), _mm256_and_si256(_mm256_slli_epi16(hv, 2), t)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), f), _mm256_and_si256(hv, t)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), f),
                                _mm256_and_si256(_mm256_srli_epi16(hv, 2), t))};
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_sub_epi8(q[i], k32);
                const __m256i a = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
                                                     _mm256_set1_epi16(sch[2 * i]));
                const __m256i z = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
                                                     _mm256_set1_epi16(sch[2 * i + 1]));
                _mm256_storeu_si256((__m256i *)(ch + 32 * i), a);
                _mm256_storeu_si256((__m256i *)(ch + 32 * i + 16), z);
            }
#else
            for (int j = 0; j < 32; j++) {
                const int is = j / 16;
                ch[j] = (int16_t)((((l[j] & 15) | ((hh[j] & 3) << 4)) - 32) * sch[is]);
                ch[j + 32] = (int16_t)((((l[j + 32] & 15) | (((hh[j] >> 2) & 3) << 4)) - 32) * sch[is + 2]);
                ch[j + 64] = (int16_t)((((l[j] >> 4) | (((hh[j] >> 4) & 3) << 4)) - 32) * sch[is + 4]);
                ch[j + 96] = (int16_t)((((l[j + 32] >> 4) | (((hh[j] >> 6) & 3) << 4)) - 32) * sch[is + 6]);
            }
#endif
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
#ifdef __AVX2__
    __m256 acc[ROW_BLOCK], acc2 = _mm256_setzero_ps();
    for (int r = 0; r < rb; r++) acc[r] = _mm256_setzero_ps();
#else
    float acc[ROW_BLOCK];
    for (int r = 0; r < rb; r++) acc[r] = 0.f;
#endif
    for (int64_t u = 0; u < K / unit; u++) {
        const int has_min = decode(type, row + u * size, c, s, m);
        for (int i = 0; i < sub; i++) {
            const int64_t g = u * sub + i;
            const int16_t *ci = c + GROUP * i;
#ifdef __AVX2__
            const __m256i c0 = _mm256_load_si256((const __m256i *)ci);
            const __m256i c1 = _mm256_load_si256((const __m256i *)(ci + 16));
            const __m256 si = _mm256_broadcast_ss(s + i);
            for (int r = 0; r < rb; r++) {
                __m256 f = _mm256_mul_ps(dot32(c0, c1, xq + r * K + g * GROUP),
                                         _mm256_broadcast_ss(dx + r * G + g));
#define ACC(a) a = _mm256_fmadd_ps(f, si, has_min ? _mm256_fmadd_ps( \
                    _mm256_loadu_ps(xs8 + (r * G + g) * 8), _mm256_broadcast_ss(m + i), a) : a)
                /* one row alternates two accumulators: a single chain would serialise */
                if (rb == 1 && (g & 1)) ACC(acc2);
                else ACC(acc[r]);
#undef ACC
            }
#else
            for (int r = 0; r < rb; r++) {
                const int16_t *xr = xq + r * K + g * GROUP;
                int32_t t = 0;
                float xs = 0.f;
                for (int j = 0; j < GROUP; j++) t += (int32_t)ci[j] * xr[j];
                for (int j = 0; j < 8; j++) xs += xs8[(r * G + g) * 8 + j];
                acc[r] += (float)t * (s[i] * dx[r * G + g]) + (has_min ? m[i] * xs : 0.f);
            }
#endif
        }
    }
#ifdef __AVX2__
    if (rb == 1) acc[0] = _mm256_add_ps(acc[0], acc2);
    for (int r = 0; r < rb; r++) y[r * N] = hsum8(acc[r]);
#else
    for (int r = 0; r < rb; r++) y[r * N] = acc[r];
#endif
}

/* One function per type, with the type a literal inside the OpenMP loop: the loop body is
 * outlined into a function of its own, where a type passed as an argument would no longer be
 * a constant (decode's switch and the sub-block loops would stay generic: 3x slower). */
#define PRODUCT(T) \
static void product_##T(const int16_t *xq, const float *dx, const float *xs8, int64_t R, int64_t K, \
                        const uint8_t *w, int64_t row_bytes, int64_t N, float *y, int threads) { \
    const int64_t G = K / GROUP; \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)") \
    for (int64_t n = 0; n < N; n++) { \
        for (int64_t b = 0, r0 = 0, rb; b < ROW_BLOCKS(R); b++, r0 += rb) { \
            rb = ROW_BLOCK_SIZE(R, b); \
            DISPATCH(rb, ROWS_##T) \
        } \
    } \
}
#define ROWS(T, RB) gguf_row(T, RB, xq + r0 * K, dx + r0 * G, xs8 + r0 * G * 8, K, w + n * row_bytes, \
                             y + r0 * N + n, N)
#define ROWS_T_Q4_0(RB) ROWS(T_Q4_0, RB)
#define ROWS_T_Q4_1(RB) ROWS(T_Q4_1, RB)
#define ROWS_T_Q5_0(RB) ROWS(T_Q5_0, RB)
#define ROWS_T_Q5_1(RB) ROWS(T_Q5_1, RB)
#define ROWS_T_Q8_0(RB) ROWS(T_Q8_0, RB)
#define ROWS_T_Q4_K(RB) ROWS(T_Q4_K, RB)
#define ROWS_T_Q5_K(RB) ROWS(T_Q5_K, RB)
#define ROWS_T_Q6_K(RB) ROWS(T_Q6_K, RB)
PRODUCT(T_Q4_0) PRODUCT(T_Q4_1) PRODUCT(T_Q5_0) PRODUCT(T_Q5_1) PRODUCT(T_Q8_0) PRODUCT(T_Q4_K)
PRODUCT(T_Q5_K) PRODUCT(T_Q6_K)

/* x [R, K] float32, w [N, row_bytes] (each row K / unit blocks of `type`, as in the file)
 * -> y [R, N]. Returns 0; -1 when out of memory; -2 for a type or width it does not take. */
int gguf_linear(const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t row_bytes,
                int type, int64_t N, float *y, int threads) {
    if (!bytes_of(type) || K % unit_of(type) || row_bytes != K / unit_of(type) * bytes_of(type))
        return -2;
    const int64_t G = K / GROUP;
    int16_t *xq = malloc(sizeof(int16_t) * R * K);
    float *dx = malloc(sizeof(float) * R * G), *xs8 = malloc(sizeof(float) * R * G * 8);
    if (!xq || !dx || !xs8) { free(xq); free(dx); free(xs8); return -1; }
    quantize_rows(x, R, K, xq, dx, xs8);
#define TYPE(T) case T: product_##T(xq, dx, xs8, R, K, w, row_bytes, N, y, threads); break;
    switch (type) {
    TYPE(T_Q4_0) TYPE(T_Q4_1) TYPE(T_Q5_0) TYPE(T_Q5_1) TYPE(T_Q8_0) TYPE(T_Q4_K) TYPE(T_Q5_K)
    TYPE(T_Q6_K)
    }
#undef TYPE
    free(xq); free(dx); free(xs8);
    return 0;
}
