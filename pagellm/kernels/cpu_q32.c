/* Many-row products of 32-value block weights (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against int8
 * activations, on CPUs with AVX-512 VNNI, or AVX2 alone for codes below 32 (pagellm/layers/q32.py;
 * the AVX2 section below says how). The drivers (row chunks, panels, the gated product) are
 * shared; each section defines the quantizers, tile(), tile_z() and gate_rows().
 *
 * Every such block is w_j = d * u_j + m with u_j an unsigned byte (Q4: the code; Q5: the 5-bit
 * code; Q8_0: the code + 128) and d, m floats (Q4_0: m = -8 d, Q5_0: -16 d, Q8_0: -128 d). The
 * activations are rounded per 32 values of a row to x_j ~ dx * xq_j (xq int8, dx = max|x| /
 * 127, as llama.cpp's Q8_1), so that for one block of a row and an output
 * (requantized weights, q32.requantize, take blocks of B = 64-256 inputs instead: one d per B
 * inputs, m = -128 d, and activations rounded per B values; every "32" of a block below is
 * then B, and the tile gathers B / 32 runs of block_products before its float work)
 *
 *     sum_j w_j x_j ~ d * dx * sum_j u_j xq_j  +  m * sx        sx = dx * sum_j xq_j
 *
 * the first sum exact in int32 (vpdpbusd: 64 byte products an instruction, twice what a bf16
 * product does per instruction), then scaled in float32. The only rounding beyond float32's
 * is the activations' (half a step of max|x| / 127 per value).
 *
 * Where m = -z d with an integer z for every block of a panel (Q4_0: 8, Q5_0: 16, Q8_0: 128),
 * the min term joins the integer sum instead: d dx (sum_j u_j xq_j - z sum_j xq_j), the block's
 * sum starting from -z sum_j xq_j (exact in int32), and the tile does one multiply and one FMA
 * per 16 outputs and block where it did three (Q4_0 / Q8_0 products of the default model's
 * shapes, folded and not alternated in one process, two Zen 4 cores: 1.05-1.07x at 64 rows,
 * 1.05-1.09x at 2,048). The same value, with one float32 rounding less.
 *
 * Codes are stored in panels of 32 outputs: [N / 32][K / 4][32][4] (each 4-byte lane holds 4
 * consecutive inputs of one output: vpdpbusd's unit; where every code is 4-bit, two a byte,
 * [N / 32][K / 4][16][4], outputs o and o + 16 in a byte's low and high nibble), d and m as
 * [N / 32][K / B][32] (B = 32 for the file's blocks). A tile is 6 rows x 32 outputs: 12
 * int32 sums for the block and 12 float32 accumulators stay in registers; per 4 inputs it
 * loads 2 code registers (or one of nibbles) and broadcasts 6 activation words for 12
 * vpdpbusd.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define Q32_ROWS 192  /* rows whose activations (192 x K bytes) stay in L2 over every panel */
#define Q32_MAX_BLOCK 256  /* the longest block of inputs one scale covers */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include "vec_math.h"
#include "q32_block.h"

#define Q32_TILE_R 6

/* The largest code the tiles take: every byte (vpdpbusd's unsigned operand) */
int q32_max_code(void) { return 255; }

/* 16 float32 -> bf16, rounded to nearest even (finite values; the quiet NaNs arithmetic
 * makes stay NaN) */
static inline __m256i to_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* One block of 32 activations (v0, v1: bf16 values, widened) -> its 32 int8 codes at xq, *dx
 * and *sx. The one rounding of activations every q32 product takes, wherever it runs. */
static inline void quantize32(__m512 v0, __m512 v1, int8_t *xq, float *dx, float *sx) {
    const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    /* v - v is 0 except for a NaN or an infinity (max_ps would drop a NaN): then the block's
     * outputs are NaN */
    const __mmask16 bad =
        _mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
        _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (bad) {
        memset(xq, 0, 32);
        *dx = *sx = NAN;
        return;
    }
    const __m512 inv = _mm512_set1_ps(int8_code_factor(mx));
    /* round to nearest (even): |v * inv| <= 127 */
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128((__m128i *)xq, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(xq + 16), _mm512_cvtsepi32_epi8(q1));
    *dx = mx / 127.f;
    *sx = mx / 127.f * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
}

/* One block of B activations (a multiple of 32, at most Q32_MAX_BLOCK; v: float32 values,
 * already bf16-rounded) -> its B int8 codes at xq, *dx and *sx: quantize32's arithmetic over
 * a longer block (B = 32 gives quantize32's codes and scales bit for bit). */
static inline void quantize_block(const float *v, int64_t B, int8_t *xq, float *dx, float *sx) {
    if (B == 32) {
        quantize32(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16), xq, dx, sx);
        return;
    }
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t i = 0; i < B; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
        bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    }
    if (bad) {
        memset(xq, 0, (size_t)B);
        *dx = *sx = NAN;
        return;
    }
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(int8_code_factor(m));
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < B; i += 16) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), inv));
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtsepi32_epi8(q));
        sum = _mm512_add_epi32(sum, q);
    }
    *dx = m / 127.f;
    *sx = m / 127.f * (float)_mm512_reduce_add_epi32(sum);
}

/* 16 float32 -> their bf16 roundings, widened back (what `.to(bfloat16)` then a bf16 load
 * give: any NaN becomes 0x7fc0, as PyTorch's conversion makes it; to_bf16x16 alone could carry
 * a NaN with a full payload over into zero) */
static inline __m512 bf16_rounded(__m512 v) {
    const __m512 r = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(v)), 16));
    return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

/* v times 16 smoothing factors at inv + at, or v where inv is NULL (Q32Linear.inv) */
static inline __m512 smoothed(__m512 v, const float *inv, int64_t at) {
    return inv ? _mm512_mul_ps(v, _mm512_loadu_ps(inv + at)) : v;
}

/* One row of K bf16 values -> xq [K] int8, dx and sx [K / B] (B: the block length, a
 * multiple of 32 dividing K). inv [K] (or NULL): each value is multiplied by its channel's
 * inv in float32 first (smoothed products, q32.Q32Linear.inv: the weights carry 1 / inv). */
void q32_quantize_row(const uint16_t *x, int64_t K, int64_t B, const float *inv, int8_t *xq,
                      float *dx, float *sx) {
    float v[Q32_MAX_BLOCK];
    for (int64_t g = 0; g < K / B; g++) {
        if (B == 32 && !inv) {
            quantize32(load_bf16x16(x + g * 32), load_bf16x16(x + g * 32 + 16), xq + g * 32,
                       dx + g, sx + g);
            continue;
        }
        for (int64_t i = 0; i < B; i += 16)
            _mm512_storeu_ps(v + i, smoothed(load_bf16x16(x + g * B + i), inv, g * B + i));
        quantize_block(v, B, xq + g * B, dx + g, sx + g);
    }
}

/* One row of K float32 values, rounded to bf16 as they are read (q32_quantize_f32) */
static void quantize_f32_row(const float *x, int64_t K, int64_t B, const float *inv,
                             int8_t *xq, float *dx, float *sx) {
    float v[Q32_MAX_BLOCK];
    for (int64_t g = 0; g < K / B; g++) {
        const float *src = x + g * B;
        for (int64_t i = 0; i < B; i += 16)
            _mm512_storeu_ps(v + i, smoothed(bf16_rounded(_mm512_loadu_ps(src + i)), inv,
                                             g * B + i));
        quantize_block(v, B, xq + g * B, dx + g, sx + g);
    }
}

/* Rows [0, RB) x the panel's 32 outputs (RB, FOLD, NIB literals after inlining) into y (row
 * stride ldy; the first `cols` of the 32 columns are written); meanwhile npf cache lines from
 * pf (the next panel's codes) go into L1. B: inputs per scale (32, or a longer block of
 * requantized codes, q32.Q32Linear.block): each block's integer sums gather B / 32 runs of
 * block_products before the float work, which is then paid once per B inputs. FOLD: the
 * panel's m is -z d, each block's sum starts from -z xs (the rows' block sums of xq) and m
 * is not read; NIB: codes in nibbles. */
static inline __attribute__((always_inline)) void tile(
        int RB, int FOLD, int NIB, int64_t B, const int8_t *xq, const float *dx,
        const float *sx, const int32_t *xs, int32_t z, int64_t K, const uint8_t *c,
        const float *d, const float *m, uint16_t *y, int64_t ldy, int cols, const char *pf,
        int64_t npf) {
    const int64_t G32 = K / 32, G = K / B, J = B / 32;
    __m512 acc[Q32_TILE_R][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i s[Q32_TILE_R][2];
        for (int r = 0; r < RB; r++)  /* FOLD: m = -z d, its term in the integer sum */
            s[r][0] = s[r][1] = FOLD ? _mm512_set1_epi32(-z * xs[r * G + g])
                                     : _mm512_setzero_si512();
        for (int64_t j = g * J; j < (g + 1) * J; j++)
            block_products(RB, 1, NIB, xq, K, j, G32, c + j * 32 * (NIB ? 16 : 32), s, pf, npf);
        const __m512 d0 = _mm512_loadu_ps(d + g * 32), d1 = _mm512_loadu_ps(d + g * 32 + 16);
        for (int r = 0; r < RB; r++) {
            const __m512 a = _mm512_set1_ps(dx[r * G + g]);
            acc[r][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][0]), a), d0,
                                        acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r][1]), a), d1,
                                        acc[r][1]);
        }
        if (!FOLD) {
            const __m512 m0 = _mm512_loadu_ps(m + g * 32), m1 = _mm512_loadu_ps(m + g * 32 + 16);
            for (int r = 0; r < RB; r++) {
                const __m512 b = _mm512_set1_ps(sx[r * G + g]);
                acc[r][0] = _mm512_fmadd_ps(m0, b, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(m1, b, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < RB; r++) {
        uint16_t *yr = y + r * ldy, tmp[32];
        uint16_t *dst = cols == 32 ? yr : tmp;
        _mm256_storeu_si256((__m256i *)dst, to_bf16x16(acc[r][0]));
        _mm256_storeu_si256((__m256i *)(dst + 16), to_bf16x16(acc[r][1]));
        if (cols < 32) memcpy(yr, tmp, sizeof(uint16_t) * cols);
    }
}

/* Rows r0 .. r0 + rb of panel p: a = silu(g) * u rounded to bf16 into a [R, I] when given;
 * with aq, each row's 32 values (one block of the next product's inputs) quantized as
 * q32_quantize would quantize them from a, into aq [R, I], adx and asx [R, I / 32]. */
static inline void gate_rows(int rb, const uint16_t *g, const uint16_t *u, int64_t r0, int64_t p,
                             int64_t I, uint16_t *a, int8_t *aq, float *adx, float *asx) {
    for (int r = 0; r < rb; r++) {
        uint16_t tmp[32];
        uint16_t *dst = a ? a + (r0 + r) * I + p * 32 : tmp;
        for (int c = 0; c < 32; c += 16)
            store_bf16x16(dst + c, silu_mul16(load_bf16x16(g + r * 32 + c),
                                              load_bf16x16(u + r * 32 + c)));
        if (aq) {
            const int64_t G = I / 32, at = (r0 + r) * G + p;
            quantize32(load_bf16x16(dst), load_bf16x16(dst + 16), aq + (r0 + r) * I + p * 32,
                       adx + at, asx + at);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (no VNNI): vpmaddubsw multiplies 32 code bytes (unsigned) by 32 activation bytes
 * (signed) and adds each pair into an int16; vpmaddwd by ones then adds pairs of those into
 * int32. Summing the int16 pairs of several steps before that widening is what makes the
 * integer product pay here: a pair is at most 2 * 31 * 127 = 7,874 for codes below 32 (Q5),
 * 3,810 below 16 (Q4), so 4 (Q5) or 8 (Q4: a whole block) pair sums fit in an int16 without
 * wrapping, and one vpmaddwd serves 4 or 8 vpmaddubsw. Codes of 32 and more (Q8_0, the
 * i-quants' levels + 128, requantized blocks) would overflow the pair sums: q32_max_code()
 * is 31 and layers/q32.py gives such forms none of these products. On a Zen 3 core
 * vpmaddubsw and FMA both issue twice a cycle: 64 byte products against 16 float32
 * multiply-adds a cycle.
 *
 * The same values as the AVX-512 build, bit for bit: the same integer sums, then the same
 * float operations lane for lane in the same order (quantizers, scales, bf16 rounding).
 * A tile is Q32_TILE_R rows x a panel's 32 outputs, taken as two halves of 16 (two ymm of
 * int16 sums a row: 16 registers hold 5 rows' sums, the codes and the broadcast word). */
#include <immintrin.h>
#include "vec_math.h"
#include "q32_block.h"

#define Q32_TILE_R 5

int q32_max_code(void) { return 31; }

/* 8 float32 -> bf16 in the low 16 bits of 8 int32, rounded to nearest even (to_bf16x16's
 * arithmetic: finite values; the quiet NaNs arithmetic makes stay NaN) */
static inline __m256i to_bf16_lanes(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                              odd), 16);
}

/* 16 float32 (a, b) -> 16 bf16 at dst */
static inline void store_bf16x2x8(uint16_t *dst, __m256 a, __m256 b) {
    const __m256i p = _mm256_packus_epi32(to_bf16_lanes(a), to_bf16_lanes(b));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permute4x64_epi64(p, 0xD8));
}

/* v - v is 0 except for a NaN or an infinity */
static inline __m256 not_finite(__m256 v) {
    return _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ);
}

static inline __m256 abs8(__m256 v) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v);
}

/* 32 int32 codes (|q| <= 127) -> 32 int8 at xq, in order */
static inline void store_codes32(int8_t *xq, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)xq, _mm256_permutevar8x32_epi32(
        b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* One block of B activations (a multiple of 32, at most Q32_MAX_BLOCK; v: float32 values,
 * already bf16-rounded) -> its B int8 codes at xq, *dx and *sx: the AVX-512 build's
 * quantize32 / quantize_block arithmetic */
static inline void quantize_block(const float *v, int64_t B, int8_t *xq, float *dx, float *sx) {
    __m256 mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t i = 0; i < B; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        mx = _mm256_max_ps(mx, abs8(x));
        bad = _mm256_or_ps(bad, not_finite(x));
    }
    if (_mm256_movemask_ps(bad)) {
        memset(xq, 0, (size_t)B);
        *dx = *sx = NAN;
        return;
    }
    const float m = hmax8(mx);
    const __m256 inv = _mm256_set1_ps(int8_code_factor(m));
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < B; i += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * k), inv));
            sum = _mm256_add_epi32(sum, q[k]);
        }
        store_codes32(xq + i, q[0], q[1], q[2], q[3]);
    }
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    *dx = m / 127.f;
    *sx = m / 127.f * (float)total;
}

/* 8 float32 -> their bf16 roundings, widened back (any NaN 0x7fc00000: bf16_rounded) */
static inline __m256 bf16_rounded(__m256 v) {
    const __m256 r = _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16_lanes(v), 16));
    return _mm256_blendv_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

static inline __m256 smoothed(__m256 v, const float *inv, int64_t at) {
    return inv ? _mm256_mul_ps(v, _mm256_loadu_ps(inv + at)) : v;
}

void q32_quantize_row(const uint16_t *x, int64_t K, int64_t B, const float *inv, int8_t *xq,
                      float *dx, float *sx) {
    float v[Q32_MAX_BLOCK];
    for (int64_t g = 0; g < K / B; g++) {
        for (int64_t i = 0; i < B; i += 8)
            _mm256_storeu_ps(v + i, smoothed(load_bf16x8(x + g * B + i), inv, g * B + i));
        quantize_block(v, B, xq + g * B, dx + g, sx + g);
    }
}

/* One row of K float32 values, rounded to bf16 as they are read (q32_quantize_f32) */
static void quantize_f32_row(const float *x, int64_t K, int64_t B, const float *inv,
                             int8_t *xq, float *dx, float *sx) {
    float v[Q32_MAX_BLOCK];
    for (int64_t g = 0; g < K / B; g++) {
        for (int64_t i = 0; i < B; i += 8)
            _mm256_storeu_ps(v + i, smoothed(bf16_rounded(_mm256_loadu_ps(x + g * B + i)), inv,
                                             g * B + i));
        quantize_block(v, B, xq + g * B, dx + g, sx + g);
    }
}

/* s[r][0..1] (8 int32 sums each: outputs 16 H + 0..7, + 8..15) += the 32-input block j's
 * products for rows [0, RB): int16 pair sums over FL steps of 4 inputs (8 for 4-bit codes,
 * 4 for 5-bit), then widened. cb: the block's codes ([8][32][4] bytes, or [8][16][4] in
 * nibbles: half H is the low or the high nibbles). */
static inline __attribute__((always_inline)) void block_products_avx2(
        int RB, int NIB, int H, const int8_t *x, int64_t K, int64_t j, const uint8_t *cb,
        __m256i s[][2], int first) {
    const int FL = NIB ? 8 : 4;
    for (int k0 = 0; k0 < 8; k0 += FL) {
        __m256i t[Q32_TILE_R][2];
        for (int r = 0; r < RB; r++) t[r][0] = t[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int kq = k0; kq < k0 + FL; kq++) {
            __m256i w0, w1;
            if (NIB) {
                w0 = _mm256_loadu_si256((const __m256i *)(cb + kq * 64));
                w1 = _mm256_loadu_si256((const __m256i *)(cb + kq * 64 + 32));
                if (H) {
                    w0 = _mm256_srli_epi16(w0, 4);
                    w1 = _mm256_srli_epi16(w1, 4);
                }
                w0 = _mm256_and_si256(w0, _mm256_set1_epi8(0x0F));
                w1 = _mm256_and_si256(w1, _mm256_set1_epi8(0x0F));
            } else {
                w0 = _mm256_loadu_si256((const __m256i *)(cb + kq * 128 + H * 64));
                w1 = _mm256_loadu_si256((const __m256i *)(cb + kq * 128 + H * 64 + 32));
            }
#pragma GCC unroll 8
            for (int r = 0; r < RB; r++) {
                int32_t word;
                memcpy(&word, x + r * K + j * 32 + kq * 4, 4);
                const __m256i xb = _mm256_set1_epi32(word);
                t[r][0] = _mm256_add_epi16(t[r][0], _mm256_maddubs_epi16(w0, xb));
                t[r][1] = _mm256_add_epi16(t[r][1], _mm256_maddubs_epi16(w1, xb));
                /* one running sum a register: left alone, the compiler computes every
                 * product of the block first and sums them after, from the stack */
                __asm__("" : "+x"(t[r][0]), "+x"(t[r][1]));
            }
        }
        for (int r = 0; r < RB; r++)  /* the first widening sets s: no sum is live before */
            for (int i = 0; i < 2; i++) {
                const __m256i w = _mm256_madd_epi16(t[r][i], _mm256_set1_epi16(1));
                s[r][i] = first && k0 == 0 ? w : _mm256_add_epi32(s[r][i], w);
            }
    }
}

/* Rows [0, RB) x outputs 16 H .. 16 H + 15 of a panel (tile's arguments) -> out[r][16 H ..],
 * bf16; with H 0 this half also sends the next panel's share (npf lines from pf) into L1. */
static inline __attribute__((always_inline)) void tile_half(
        int RB, int FOLD, int NIB, int H, int64_t B, const int8_t *xq, const float *dx,
        const float *sx, const int32_t *xs, int32_t z, int64_t K, const uint8_t *c,
        const float *d, const float *m, uint16_t out[][32], const char *pf, int64_t npf) {
    const int64_t G32 = K / 32, G = K / B, J = B / 32;
    __m256 acc[Q32_TILE_R][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t line = 0, due = 0;  /* block j sends lines up to (j + 1) npf / G32 (no division) */
    for (int64_t g = 0; g < G; g++) {
        __m256i s[Q32_TILE_R][2] = {{_mm256_setzero_si256()}};  /* each set by its block's first widening */
        for (int64_t j = g * J; j < (g + 1) * J; j++) {
            if (!H)
                for (due += npf; due >= G32; due -= G32)
                    _mm_prefetch(pf + 64 * line++, _MM_HINT_T0);
            block_products_avx2(RB, NIB, H, xq, K, j, c + j * 32 * (NIB ? 16 : 32), s,
                                j == g * J);
        }
        if (FOLD)  /* m = -z d: its term in the integer sum */
            for (int r = 0; r < RB; r++)
                for (int i = 0; i < 2; i++)
                    s[r][i] = _mm256_add_epi32(s[r][i], _mm256_set1_epi32(-z * xs[r * G + g]));
        const __m256 d0 = _mm256_loadu_ps(d + g * 32 + H * 16);
        const __m256 d1 = _mm256_loadu_ps(d + g * 32 + H * 16 + 8);
        for (int r = 0; r < RB; r++) {
            const __m256 a = _mm256_set1_ps(dx[r * G + g]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[r][0]), a), d0,
                                        acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[r][1]), a), d1,
                                        acc[r][1]);
        }
        if (!FOLD) {
            const __m256 m0 = _mm256_loadu_ps(m + g * 32 + H * 16);
            const __m256 m1 = _mm256_loadu_ps(m + g * 32 + H * 16 + 8);
            for (int r = 0; r < RB; r++) {
                const __m256 b = _mm256_set1_ps(sx[r * G + g]);
                acc[r][0] = _mm256_fmadd_ps(m0, b, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(m1, b, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < RB; r++) store_bf16x2x8(out[r] + H * 16, acc[r][0], acc[r][1]);
}

/* The AVX-512 build's tile (see there), for codes below 32: rows [0, RB) x the panel's 32
 * outputs into y, as two halves of 16 outputs. */
static inline __attribute__((always_inline)) void tile(
        int RB, int FOLD, int NIB, int64_t B, const int8_t *xq, const float *dx,
        const float *sx, const int32_t *xs, int32_t z, int64_t K, const uint8_t *c,
        const float *d, const float *m, uint16_t *y, int64_t ldy, int cols, const char *pf,
        int64_t npf) {
    uint16_t out[Q32_TILE_R][32];
    tile_half(RB, FOLD, NIB, 0, B, xq, dx, sx, xs, z, K, c, d, m, out, pf, npf);
    tile_half(RB, FOLD, NIB, 1, B, xq, dx, sx, xs, z, K, c, d, m, out, pf, npf);
    for (int r = 0; r < RB; r++) memcpy(y + r * ldy, out[r], sizeof(uint16_t) * cols);
}

/* gate_rows of the AVX-512 build, 8 values at a time (the same bits) */
static inline void gate_rows(int rb, const uint16_t *g, const uint16_t *u, int64_t r0, int64_t p,
                             int64_t I, uint16_t *a, int8_t *aq, float *adx, float *asx) {
    for (int r = 0; r < rb; r++) {
        uint16_t tmp[32];
        uint16_t *dst = a ? a + (r0 + r) * I + p * 32 : tmp;
        for (int c = 0; c < 32; c += 8)
            store_bf16x8(dst + c, silu_mul8(load_bf16x8(g + r * 32 + c),
                                            load_bf16x8(u + r * 32 + c)));
        if (aq) {
            float v[32];
            for (int c = 0; c < 32; c += 8) _mm256_storeu_ps(v + c, load_bf16x8(dst + c));
            const int64_t G = I / 32, at = (r0 + r) * G + p;
            quantize_block(v, 32, aq + (r0 + r) * I + p * 32, adx + at, asx + at);
        }
    }
}
#endif

#ifdef Q32_TILE_R
/* tile() for a panel whose zero z (0: its float min term) and code width (nib: 4-bit codes
 * two a byte) are known only at run time */
static inline __attribute__((always_inline)) void tile_z(
        int RB, int32_t z, int nib, int64_t B, const int8_t *xq, const float *dx,
        const float *sx, const int32_t *xs, int64_t K, const uint8_t *c, const float *d,
        const float *m, uint16_t *y, int64_t ldy, int cols, const char *pf, int64_t npf) {
    if (nib && z)
        tile(RB, 1, 1, B, xq, dx, sx, xs, z, K, c, d, m, y, ldy, cols, pf, npf);
    else if (nib)
        tile(RB, 0, 1, B, xq, dx, sx, xs, 0, K, c, d, m, y, ldy, cols, pf, npf);
    else if (z)
        tile(RB, 1, 0, B, xq, dx, sx, xs, z, K, c, d, m, y, ldy, cols, pf, npf);
    else
        tile(RB, 0, 0, B, xq, dx, sx, xs, 0, K, c, d, m, y, ldy, cols, pf, npf);
}

/* x [R, K] bf16 -> xq [R, K] int8, dx and sx [R, K / B] (inv: q32_quantize_row's) */
void q32_quantize(const uint16_t *x, int64_t R, int64_t K, int64_t B, const float *inv,
                  int8_t *xq, float *dx, float *sx, int threads) {
    const int64_t G = K / B;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R >= 16)
    for (int64_t r = 0; r < R; r++)
        q32_quantize_row(x + r * K, K, B, inv, xq + r * K, dx + r * G, sx + r * G);
}

/* x [R, K] float32 -> the same as q32_quantize of x rounded to bf16 first (no bf16 copy) */
void q32_quantize_f32(const float *x, int64_t R, int64_t K, int64_t B, const float *inv,
                      int8_t *xq, float *dx, float *sx, int threads) {
    const int64_t G = K / B;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R >= 16)
    for (int64_t r = 0; r < R; r++)
        quantize_f32_row(x + r * K, K, B, inv, xq + r * K, dx + r * G, sx + r * G);
}

/* Each tile of a panel sends its share of the next panel's codes into L1, a few lines a
 * block (next_panel_share). The weights stream from memory (a decode step reads every
 * layer's), and without it a panel's first tile waited on its codes: measured on one Zen 4
 * core, 6 x 32 tiles over 60 rows, K = 576 / 1536, weights from DRAM: 64% / 63% of vpdpbusd's
 * peak -> 71% / 71% (72% with every panel in L2); the default model's 64-row decode step 3%
 * faster. */
#define Q32_TILE(RB) do { \
        int64_t pf; \
        const int64_t npf = next_panel_share(pb, Q32_TILE_R, r1 - r0, r - r0, p + 1 >= P, &pf); \
        tile_z(RB, z, nibbles, B, xq + r * K, dx + r * G, sx + r * G, xs + r * G, K, cp, dp, \
               mp, y + r * N + p * 32, N, cols, (const char *)cp + pb + pf * 64, npf); \
    } while (0)

/* xs [R, K / B]: each block's sum of xq (for panels whose min term folds), or NULL where
 * no panel folds (zeros NULL, or all 0). Returns 0, or -1 when out of memory. */
static int block_sums(const int8_t *xq, int64_t R, int64_t K, int64_t B, int64_t P,
                      const int32_t *zeros, int32_t **xs, int threads) {
    *xs = NULL;
    int any = 0;
    for (int64_t p = 0; zeros && p < P && !any; p++) any = zeros[p] != 0;
    if (!any) return 0;
    const int64_t G = K / B;
    int32_t *out = malloc(sizeof(int32_t) * (R * G > 0 ? R * G : 1));
    if (!out) return -1;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R >= 64)
    for (int64_t i = 0; i < R * G; i++) {  /* sum of (x + 128) by sad against 0, less B * 128 */
        int64_t t = 0;
        for (int64_t j = 0; j < B; j += 32) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + i * B + j));
            const __m256i u = _mm256_sad_epu8(_mm256_xor_si256(x, flip), _mm256_setzero_si256());
            t += _mm256_extract_epi64(u, 0) + _mm256_extract_epi64(u, 1) +
                 _mm256_extract_epi64(u, 2) + _mm256_extract_epi64(u, 3);
        }
        out[i] = (int32_t)(t - B * 128);
    }
    *xs = out;
    return 0;
}

/* xq, dx, sx (q32_quantize with block B) of R rows; codes, d, m of N outputs in panels (N
 * rounded up to 32 in the panels; d, m one per B inputs; nibbles: every code 4-bit, two a
 * byte), zeros [P] (z where every m of panel p is -z d, else 0; or NULL) -> y [R, N] bf16.
 * K a multiple of B, B of 32. Returns 0, or -1 when out of memory. */
int q32_linear(const int8_t *xq, const float *dx, const float *sx, int64_t R, int64_t K,
               int64_t B, const uint8_t *c, const float *d, const float *m,
               const int32_t *zeros, int nibbles, int64_t N, uint16_t *y, int threads) {
    const int64_t P = (N + 31) / 32, G = K / B, pb = (nibbles ? 16 : 32) * K;
    int32_t *xs;
    if (block_sums(xq, R, K, B, P, zeros, &xs, threads)) return -1;
    for (int64_t r0 = 0; r0 < R; r0 += Q32_ROWS) {
        const int64_t r1 = r0 + Q32_ROWS < R ? r0 + Q32_ROWS : R;
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *cp = c + p * pb;
            const float *dp = d + p * G * 32, *mp = m + p * G * 32;
            const int32_t z = xs ? zeros[p] : 0;
            const int cols = N - p * 32 < 32 ? (int)(N - p * 32) : 32;
            int64_t r = r0;
            for (; r + Q32_TILE_R <= r1; r += Q32_TILE_R) Q32_TILE(Q32_TILE_R);
            switch (r1 - r) {
#if Q32_TILE_R > 5
            case 5: Q32_TILE(5); break;
#endif
#if Q32_TILE_R > 4
            case 4: Q32_TILE(4); break;
#endif
            case 3: Q32_TILE(3); break;
            case 2: Q32_TILE(2); break;
            case 1: Q32_TILE(1); break;
            default: break;
            }
        }
    }
    free(xs);
    return 0;
}

/* The MLP's gate|up product with its gating: N = 2I outputs (gate panels, then up panels;
 * I a multiple of 32) -> a [R, I] bf16 = silu(gate) * up. Each tile's gate and up outputs are
 * rounded to bf16 into buffers and gated as silu_mul_bf16 (cpu_layer.c) gates them, the same
 * operations in the same order: the same bits as q32_linear then silu_mul_bf16, without the
 * [R, 2I] product written and read back, nor a second pass (at 2,048 rows of the default
 * model that pass took 2 ms a layer). */
#define Q32_GATED_TILE(RB) do { \
        int64_t pf; \
        const int64_t npf = next_panel_share(pb, Q32_TILE_R, r1 - r0, r - r0, p + 1 >= P, &pf); \
        tile_z(RB, zg, nibbles, B, xq + r * K, dx + r * G, sx + r * G, xs + r * G, K, cg, dg, \
               mg, gbuf, 32, 32, (const char *)cg + pb + pf * 64, npf); \
        tile_z(RB, zu, nibbles, B, xq + r * K, dx + r * G, sx + r * G, xs + r * G, K, cu, du, \
               mu, ubuf, 32, 32, (const char *)cu + pb + pf * 64, npf); \
        gate_rows(RB, gbuf, ubuf, r, p, I, ga, gq, adx, asx); } while (0)

/* Bq: the block of the next product's activations (aq), inv its channels' factors (or NULL:
 * q32_quantize_row's). At 32 without inv a panel's 32 gated values of a row are one such
 * block, quantized in the tile; otherwise (a longer block spans several panels) the gated
 * values go to a bf16 buffer and each chunk of rows is quantized once all its panels are
 * done, while it is still in cache. */
static int gated(const int8_t *xq, const float *dx, const float *sx, int64_t R, int64_t K,
                 int64_t B, const uint8_t *c, const float *d, const float *m,
                 const int32_t *zeros, int nibbles, int64_t N, uint16_t *a, int8_t *aq,
                 float *adx, float *asx, int64_t Bq, const float *inv, int threads) {
    const int64_t I = N / 2, P = I / 32, G = K / B, pb = (nibbles ? 16 : 32) * K;
    const int later = aq && (Bq != 32 || inv);  /* quantized after each chunk of rows */
    uint16_t *ga = a;
    if (later && !ga && !(ga = malloc(sizeof(uint16_t) * (R * I > 0 ? R * I : 1)))) return -1;
    int8_t *gq = later ? NULL : aq;
    int32_t *xs;
    if (block_sums(xq, R, K, B, 2 * P, zeros, &xs, threads)) {
        if (ga != a) free(ga);
        return -1;
    }
    for (int64_t r0 = 0; r0 < R; r0 += Q32_ROWS) {
        const int64_t r1 = r0 + Q32_ROWS < R ? r0 + Q32_ROWS : R;
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t p = 0; p < P; p++) {
            const uint8_t *cg = c + p * pb, *cu = c + (p + P) * pb;
            const float *dg = d + p * G * 32, *mg = m + p * G * 32;
            const float *du = d + (p + P) * G * 32, *mu = m + (p + P) * G * 32;
            const int32_t zg = xs ? zeros[p] : 0, zu = xs ? zeros[p + P] : 0;
            uint16_t gbuf[Q32_TILE_R * 32], ubuf[Q32_TILE_R * 32];
            int64_t r = r0;
            for (; r + Q32_TILE_R <= r1; r += Q32_TILE_R) Q32_GATED_TILE(Q32_TILE_R);
            switch (r1 - r) {
#if Q32_TILE_R > 5
            case 5: Q32_GATED_TILE(5); break;
#endif
#if Q32_TILE_R > 4
            case 4: Q32_GATED_TILE(4); break;
#endif
            case 3: Q32_GATED_TILE(3); break;
            case 2: Q32_GATED_TILE(2); break;
            case 1: Q32_GATED_TILE(1); break;
            default: break;
            }
        }
        if (later)
            q32_quantize(ga + r0 * I, r1 - r0, I, Bq, inv, aq + r0 * I, adx + r0 * (I / Bq),
                         asx + r0 * (I / Bq), threads);
    }
    free(xs);
    if (ga != a) free(ga);
    return 0;
}

/* Returns 0, or -1 when out of memory (as q32_linear_gated_q). */
int q32_linear_gated(const int8_t *xq, const float *dx, const float *sx, int64_t R, int64_t K,
                     int64_t B, const uint8_t *c, const float *d, const float *m,
                     const int32_t *zeros, int nibbles, int64_t N, uint16_t *a, int threads) {
    return gated(xq, dx, sx, R, K, B, c, d, m, zeros, nibbles, N, a, NULL, NULL, NULL, 32, NULL,
                 threads);
}

/* The gated product's output as the next product's int8 activations only (blocks of Bq, inv
 * its factors or NULL): aq [R, N / 2], adx and asx [R, N / 2 / Bq], the values
 * q32_linear_gated then q32_quantize give. */
int q32_linear_gated_q(const int8_t *xq, const float *dx, const float *sx, int64_t R,
                       int64_t K, int64_t B, const uint8_t *c, const float *d, const float *m,
                       const int32_t *zeros, int nibbles, int64_t N, int8_t *aq, float *adx,
                       float *asx, int64_t Bq, const float *inv, int threads) {
    return gated(xq, dx, sx, R, K, B, c, d, m, zeros, nibbles, N, NULL, aq, adx, asx, Bq, inv,
                 threads);
}
#else
/* Without AVX-512 VNNI or AVX2 these products are not offered (layers/q32.py asks first). */
int q32_max_code(void) { return 0; }

void q32_quantize(const uint16_t *x, int64_t R, int64_t K, int64_t B, const float *inv,
                  int8_t *xq, float *dx, float *sx, int threads) {
    (void)x; (void)R; (void)K; (void)B; (void)inv; (void)xq; (void)dx; (void)sx; (void)threads;
}

void q32_quantize_row(const uint16_t *x, int64_t K, int64_t B, const float *inv, int8_t *xq,
                      float *dx, float *sx) {
    (void)x; (void)K; (void)B; (void)inv; (void)xq; (void)dx; (void)sx;
}

void q32_quantize_f32(const float *x, int64_t R, int64_t K, int64_t B, const float *inv,
                      int8_t *xq, float *dx, float *sx, int threads) {
    (void)x; (void)R; (void)K; (void)B; (void)inv; (void)xq; (void)dx; (void)sx; (void)threads;
}

int q32_linear_gated_q(const int8_t *xq, const float *dx, const float *sx, int64_t R,
                       int64_t K, int64_t B, const uint8_t *c, const float *d, const float *m,
                       const int32_t *zeros, int nibbles, int64_t N, int8_t *aq, float *adx,
                       float *asx, int64_t Bq, const float *inv, int threads) {
    (void)xq; (void)dx; (void)sx; (void)R; (void)K; (void)B; (void)c; (void)d; (void)m;
    (void)zeros; (void)nibbles; (void)N; (void)aq; (void)adx; (void)asx; (void)Bq; (void)inv;
    (void)threads;
    return -1;
}

int q32_linear(const int8_t *xq, const float *dx, const float *sx, int64_t R, int64_t K,
               int64_t B, const uint8_t *c, const float *d, const float *m,
               const int32_t *zeros, int nibbles, int64_t N, uint16_t *y, int threads) {
    (void)xq; (void)dx; (void)sx; (void)R; (void)K; (void)B; (void)c; (void)d; (void)m;
    (void)zeros; (void)nibbles; (void)N; (void)y; (void)threads;
    return -1;
}

int q32_linear_gated(const int8_t *xq, const float *dx, const float *sx, int64_t R, int64_t K,
                     int64_t B, const uint8_t *c, const float *d, const float *m,
                     const int32_t *zeros, int nibbles, int64_t N, uint16_t *y, int threads) {
    (void)xq; (void)dx; (void)sx; (void)R; (void)K; (void)B; (void)c; (void)d; (void)m;
    (void)zeros; (void)nibbles; (void)N; (void)y; (void)threads;
    return -1;
}
#endif
