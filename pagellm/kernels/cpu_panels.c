/* Few-row products of 4- and 5-bit block weights with the codes in panels of 16 outputs, on CPUs
 * with AVX-512 BW and VNNI (pagellm/layers/quant.py: NativeQ4 and NativePanels; elsewhere the
 * row layouts of cpu_quant.c and cpu_gguf.c stay).
 *
 * Every format is, per 32-value block of an output, w = scale * q + min with an integer code
 * q. Each 32-value block of x is
 * scaled to int16 (x ~ dx * xq, quantize_rows), the integer block sums are exact, then
 *
 *     sum_j w_j x_j ~ scale * dx * sum_j q_j xq_j + min * sum_j x_j
 *
 * Why panels: with one output's codes in a row, each block of each output costs a widening,
 * multiply-adds, a horizontal sum, scalar scale products and broadcasts (~14 instructions per
 * 20 bytes of Q4 weights): a one-row product ran at ~22 GB/s of weights, about half of what
 * memory gives two cores, and 5-8 rows were compute-bound. Here a 512-bit register holds 16
 * outputs' codes for 2 inputs each (one int32 lane an output), so a block of 16 outputs is 8
 * widenings, 16 vpdpwssd a row with the activations broadcast, and one vector of scales and of
 * mins for all 16: ~4x fewer instructions per byte, and a lane's block sum is already whole
 * (no horizontal sum; the float part once per block and 16 outputs).
 *
 * Codes, panel p (outputs 16p .. 16p + 15, zero past N), block g (inputs 32g .. +31): 8 groups
 * of 32 bytes; in group c, byte 2o + t (output o, t = 0, 1) holds the low 4 bits of input
 * 4c + t in its low nibble and of input 4c + 2 + t in its high one: widened to int16, lane o
 * holds inputs (4c, 4c + 1) after a nibble mask and (4c + 2, 4c + 3) after a shift by 4.
 * Formats (bytes per panel and block unless said):
 *   PF_Q4_F32 (0): codes 256, scales float32 [16], mins float32 [16]                  = 384
 *   PF_Q4_F16 (1): codes 256, scales fp16 [16], mins fp16 [16]                          = 320
 *   PF_Q5_F16 (2): codes 256, fifth bits 64 (per group: a 32-bit mask for the nibble-mask
 *                  register, one for the shifted one; bit 2o + t), scales, mins fp16    = 384
 *   PF_Q4_K   (3): per 256 inputs d [16], dmin [16] fp16 (64), the file's 12 bytes of 6-bit
 *                  scales and mins as three words [3][16] (192), then 8 blocks of codes
 *                  (256 each): scale = d * sc, min = -dmin * m; the file's size    = 2304
 *   PF_Q4_K8  (4): PF_Q4_K's bytes with each block's codes for int8 activations (below) = 2304
 *   PF_Q6_K8  (5): per 256 inputs d [16] fp16 (32), the file's int8 scales [16 groups of 16
 *                  inputs][16] (256), then 8 blocks of 384: the codes' low 4 bits as
 *                  PF_Q4_K8's (256) and their high 2 bits in 2 registers of 64 (128; in
 *                  register h, byte 4o + j holds from bit 0 two bits each of register 2h's
 *                  low-nibble code, its high-nibble code, register 2h + 1's low, its high):
 *                  w = d * sc * (q - 32), q = low | high << 4; the file's size      = 3360
 *   PF_IQ4_NL8 (6): codes 256 as PF_Q4_K8's, scales fp16 [16]                          = 288
 *   PF_IQ4_XS8 (7): per 256 inputs d [16] fp16 (32), the 8 blocks' signed 6-bit scales
 *                  ls - 32 as int8 [8][16] (128), then 8 blocks of codes as PF_Q4_K8's
 *                  (256 each): scale = d * (ls - 32)                                 = 2208
 *                  (the file's 136 bytes an output per 256 inputs: 138)
 *                  The i-quants' 4-bit codes index a table of 16 signed levels
 *                  (kvalues_iq4nl); the kernel looks each up (vpshufb) as the level + 128,
 *                  an unsigned byte for vpdpbusd, and takes 128 * sum(xq) back off through
 *                  the min term: w = scale * (level + 128) - 128 * scale, exactly the file's.
 * (Q6_K takes panels with int8 activations only: with int16 ones, its 2-bit planes made it
 * 0.8-0.9x cpu_gguf_avx512.c's rows at 1-5 rows.)
 * Panels are consecutive, each its blocks in order: a thread streams its panels' bytes.
 *
 * Integer ranges: a lane sums 32 products of q <= 31 and |xq| <= 32767 (< 2^25; converted to
 * float32 exactly below 2^24, Q5's largest sums rounded by at most one unit in 2^24).
 *
 * PF_Q4_K8 takes int8 activations instead (x ~ dx * xq per 32 values, |xq| <= 127, as
 * llama.cpp's Q8_K and this project's q32 many-row products): vpdpbusd multiplies 4 unsigned
 * codes by 4 signed activations per int32 lane, 64 products an instruction against
 * vpdpwssd's 32, and the codes need no widening. A block is 4 registers of 64 bytes; in
 * register a, byte 4o + j holds output o's code of input 4a + j in its low nibble and of input
 * 16 + 4a + j in its high one, so one mask and one shift give two vpdpbusd operands: 8
 * vpdpbusd a row per block of 16 outputs x 32 inputs (16 vpdpwssd and 8 widenings above). The
 * min term takes the sum of the rounded activations (dx * sum xq, as q32 does): the error is
 * then sum_j w_j e_j with e_j the roundings, and a K-quant's w = d sc u - dmin m is centred
 * where its code part d sc u is not (with x's exact sum the error is sum_j d sc u_j e_j, ~1.9x
 * larger for codes spread over 0..15).
 * A lane's sum: 32 products of q <= 15 and |xq| <= 127, exact in float32 (the i-quants' looked-up
 * codes: level + 128 <= 241, 32 * 241 * 127 < 2^24, exact too).
 * PF_Q6_K8: the same registers with two more bits a code (q <= 63); each 16-input group's
 * sum (the file's scales are per 16) less 32 * sum(xq) is exact (|.| <= 16 * 32 * 127), then
 * scaled by d * sc in float32.
 * Each output is computed by one thread: the same result on any thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include "quant_rows.h"

enum { PF_Q4_F32 = 0, PF_Q4_F16 = 1, PF_Q5_F16 = 2, PF_Q4_K = 3, PF_Q4_K8 = 4, PF_Q6_K8 = 5,
       PF_IQ4_NL8 = 6, PF_IQ4_XS8 = 7 };
#define P_OUT 16
#define P_TILE 6  /* rows a pass over a panel's codes takes */
#ifndef P_PF
#define P_PF 4096  /* bytes ahead the weights are asked for */
#endif

/* bytes of a panel per unit (32 inputs; 256 for the K formats), and inputs per unit */
static inline int64_t unit_bytes(int fmt) {
    switch (fmt) {
    case PF_Q4_F32: return 384; case PF_Q4_F16: return 320; case PF_Q5_F16: return 384;
    case PF_Q4_K: case PF_Q4_K8: return 2304; case PF_Q6_K8: return 3360;
    case PF_IQ4_NL8: return 288; case PF_IQ4_XS8: return 2208; default: return 0;
    }
}
static inline int64_t unit_inputs(int fmt) {
    return fmt >= PF_Q4_K && fmt != PF_IQ4_NL8 ? 256 : 32;
}
static inline int is_iq4(int fmt) { return fmt == PF_IQ4_NL8 || fmt == PF_IQ4_XS8; }
static inline int is_k(int fmt) { return fmt == PF_Q4_K || fmt == PF_Q4_K8; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <string.h>

int panels_available(void) { return 1; }

/* two int16 activations in every lane: a broadcast straight from memory (a load, where a
 * copy through a general register first costs a shuffle on the vector ports as well) */
typedef int32_t __attribute__((may_alias, aligned(2))) pair_t;
static inline __m512i word(const int16_t *p) { return _mm512_set1_epi32(*(const pair_t *)p); }

static inline __m512 f16x16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* One 32-input block of a panel for rows [0, RB): integer sums of the first and second 16
 * inputs (groups 0-3, 4-7: two chains of 8 vpdpwssd a row, not one of 16) into sa, sb.
 * codes: the block's 256 code bytes; hi: Q5's fifth-bit masks. */
static inline __attribute__((always_inline)) void block_sums(
        int FMT, int RB, const uint8_t *codes, const uint8_t *hi, const int16_t *xq, int64_t K,
        __m512i *sa, __m512i *sb) {
    const __m512i nib = _mm512_set1_epi16(0x0F);
    for (int r = 0; r < RB; r++) sa[r] = sb[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * c)));
        __m512i lo = _mm512_and_si512(v, nib), up = _mm512_srli_epi16(v, 4);
        if (FMT == PF_Q5_F16) {
            uint32_t ml, mu;
            memcpy(&ml, hi + 8 * c, 4);
            memcpy(&mu, hi + 8 * c + 4, 4);
            const __m512i sixteen = _mm512_set1_epi16(16);
            lo = _mm512_mask_add_epi16(lo, (__mmask32)ml, lo, sixteen);
            up = _mm512_mask_add_epi16(up, (__mmask32)mu, up, sixteen);
        }
        for (int r = 0; r < RB; r++) {
            const int16_t *xr = xq + r * K + 4 * c;
            __m512i s = c < 4 ? sa[r] : sb[r];
            s = _mm512_dpwssd_epi32(s, lo, word(xr));
            s = _mm512_dpwssd_epi32(s, up, word(xr + 2));
            if (c < 4) sa[r] = s; else sb[r] = s;
        }
    }
}

/* four int8 activations in every lane, broadcast from memory */
typedef int32_t __attribute__((may_alias, aligned(1))) quad4_t;
static inline __m512i quad(const int8_t *p) { return _mm512_set1_epi32(*(const quad4_t *)p); }

/* block_sums for PF_Q4_K8: the low nibbles (inputs 0-15) sum into sa, the high ones into sb */
static inline __attribute__((always_inline)) void block_sums8(
        int RB, const uint8_t *codes, const int8_t *xq, int64_t K, __m512i *sa, __m512i *sb) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < RB; r++) sa[r] = sb[r] = _mm512_setzero_si512();
    for (int a = 0; a < 4; a++) {
        const __m512i v = _mm512_loadu_si512(codes + 64 * a);
        const __m512i lo = _mm512_and_si512(v, nib);
        const __m512i up = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int r = 0; r < RB; r++) {
            const int8_t *xr = xq + r * K + 4 * a;
            sa[r] = _mm512_dpbusd_epi32(sa[r], lo, quad(xr));
            sb[r] = _mm512_dpbusd_epi32(sb[r], up, quad(xr + 16));
        }
    }
}

/* block_sums8 for the i-quants: each 4-bit code looked up in `levels` (the 16 levels + 128,
 * in every 128-bit lane) before its product */
static inline __attribute__((always_inline)) void block_sums8_levels(
        int RB, const uint8_t *codes, const int8_t *xq, int64_t K, __m512i levels,
        __m512i *sa, __m512i *sb) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < RB; r++) sa[r] = sb[r] = _mm512_setzero_si512();
    for (int a = 0; a < 4; a++) {
        const __m512i v = _mm512_loadu_si512(codes + 64 * a);
        const __m512i lo = _mm512_shuffle_epi8(levels, _mm512_and_si512(v, nib));
        const __m512i up = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
        for (int r = 0; r < RB; r++) {
            const int8_t *xr = xq + r * K + 4 * a;
            sa[r] = _mm512_dpbusd_epi32(sa[r], lo, quad(xr));
            sb[r] = _mm512_dpbusd_epi32(sb[r], up, quad(xr + 16));
        }
    }
}

/* kvalues_iq4nl + 128 (ggml-common.h's i-quant levels), as unsigned bytes */
static const uint8_t IQ4_LEVELS[16] = {1, 24, 45, 63, 79, 93, 106, 118,
                                       129, 141, 153, 166, 181, 197, 217, 241};

/* Rows [0, RB) of x (row stride K; dx, xs per 32 inputs, row stride G) over one panel; y row
 * stride N, the first `cols` outputs written. */
static inline __attribute__((always_inline)) void panel_tile(
        int FMT, int RB, const void *xq, const float *dx, const float *xs, int64_t K,
        const uint8_t *panel, float *y, int64_t N, int cols) {
    const int64_t G = K / GROUP, U = K / unit_inputs(FMT), UB = unit_bytes(FMT);
    const int inner = (int)(unit_inputs(FMT) / GROUP);
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_LEVELS));
    __m512 acc[P_TILE];
    for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < U; u++) {
        const uint8_t *ub = panel + u * UB;
        for (int l = 0; l < UB; l += 64) _mm_prefetch((const char *)ub + P_PF + l, _MM_HINT_T1);
        __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
        __m512i sc03 = _mm512_setzero_si512(), sc47 = sc03, m03 = sc03, m47 = sc03;
        if (FMT == PF_IQ4_XS8) d = f16x16(ub);
        if (is_k(FMT)) {
            d = f16x16(ub);
            dmin = f16x16(ub + 32);
            /* the 6-bit scales and mins of 16 outputs, a byte each in 4 vectors (as
             * k4_scales_mins in gguf_types.h does for one output) */
            const __m512i A = _mm512_loadu_si512(ub + 64), B = _mm512_loadu_si512(ub + 128);
            const __m512i C = _mm512_loadu_si512(ub + 192);
            const __m512i lo6 = _mm512_set1_epi32(0x3f3f3f3f), lo4 = _mm512_set1_epi32(0x0f0f0f0f);
            const __m512i lo2 = _mm512_set1_epi32(0x03030303);
            sc03 = _mm512_and_si512(A, lo6);
            m03 = _mm512_and_si512(B, lo6);
            sc47 = _mm512_or_si512(_mm512_and_si512(C, lo4),
                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(A, 6), lo2), 4));
            m47 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 4), lo4),
                                  _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(B, 6), lo2), 4));
        }
        for (int i = 0; i < inner; i++) {
            const int64_t g = u * inner + i;
            const uint8_t *b = is_k(FMT) ? ub + 256 + 256 * i
                             : FMT == PF_IQ4_XS8 ? ub + 160 + 256 * i : ub;
            __m512i sa[P_TILE], sb[P_TILE];
            if (FMT == PF_Q4_K8)
                block_sums8(RB, b, (const int8_t *)xq + g * GROUP, K, sa, sb);
            else if (is_iq4(FMT))
                block_sums8_levels(RB, b, (const int8_t *)xq + g * GROUP, K, levels, sa, sb);
            else
                block_sums(FMT, RB, b, b + 256, (const int16_t *)xq + g * GROUP, K, sa, sb);
            __m512 sc, mn;
            if (FMT == PF_Q4_F32) {
                sc = _mm512_loadu_ps((const float *)(b + 256));
                mn = _mm512_loadu_ps((const float *)(b + 320));
            } else if (FMT == PF_Q4_F16) {
                sc = f16x16(b + 256);
                mn = f16x16(b + 288);
            } else if (FMT == PF_Q5_F16) {
                sc = f16x16(b + 320);
                mn = f16x16(b + 352);
            } else if (is_iq4(FMT)) {  /* the levels' +128 comes back off as a min term */
                sc = FMT == PF_IQ4_NL8 ? f16x16(b + 256) : _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ub + 32 + 16 * i)))));
                mn = _mm512_mul_ps(sc, _mm512_set1_ps(-128.f));
            } else {  /* Q4_K, Q4_K8: byte i % 4 of each output's word */
                const __m512i byte = _mm512_set1_epi32(0xFF);
                const int sh = 8 * (i & 3);
                sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(
                    _mm512_srli_epi32(i < 4 ? sc03 : sc47, sh), byte)));
                mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(
                    _mm512_srli_epi32(i < 4 ? m03 : m47, sh), byte)));
                mn = _mm512_sub_ps(_mm512_setzero_ps(), mn);
            }
            for (int r = 0; r < RB; r++) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(sa[r], sb[r]));
                acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(dx[r * G + g])),
                                         _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[r * G + g]), acc[r]));
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < RB; r++) _mm512_mask_storeu_ps(y + r * N, keep, acc[r]);
}

#define TILES(FMT, XT) do { \
        for (int64_t t = 0, r0 = 0, rb; t < tiles; t++, r0 += rb) { \
            rb = R / tiles + (t < R % tiles); \
            const XT *xt = xq + r0 * K; \
            const float *dt = dx + r0 * G, *st = xs + r0 * G; \
            float *yt = y + r0 * N + p * P_OUT; \
            switch (rb) { \
            case 1: panel_tile(FMT, 1, xt, dt, st, K, panel, yt, N, cols); break; \
            case 2: panel_tile(FMT, 2, xt, dt, st, K, panel, yt, N, cols); break; \
            case 3: panel_tile(FMT, 3, xt, dt, st, K, panel, yt, N, cols); break; \
            case 4: panel_tile(FMT, 4, xt, dt, st, K, panel, yt, N, cols); break; \
            case 5: panel_tile(FMT, 5, xt, dt, st, K, panel, yt, N, cols); break; \
            default: panel_tile(FMT, 6, xt, dt, st, K, panel, yt, N, cols); break; \
            } \
        } } while (0)

/* One function per format, so that each panel_tile has its format as a literal. */
#define PANEL_PRODUCT(NAME, FMT, XT) \
static void NAME(const XT *xq, const float *dx, const float *xs, int64_t R, int64_t K, \
                 const uint8_t *panels, int64_t N, float *y, int threads) { \
    const int64_t G = K / GROUP, P = (N + P_OUT - 1) / P_OUT; \
    const int64_t bytes = K / unit_inputs(FMT) * unit_bytes(FMT); \
    const int64_t tiles = (R + P_TILE - 1) / P_TILE; \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)") \
    for (int64_t p = 0; p < P; p++) { \
        const uint8_t *panel = panels + p * bytes; \
        const int cols = N - p * P_OUT < P_OUT ? (int)(N - p * P_OUT) : P_OUT; \
        TILES(FMT, XT); \
    } \
}
PANEL_PRODUCT(product_q4_f32, PF_Q4_F32, int16_t)
PANEL_PRODUCT(product_q4_f16, PF_Q4_F16, int16_t)
PANEL_PRODUCT(product_q5_f16, PF_Q5_F16, int16_t)
PANEL_PRODUCT(product_q4_k, PF_Q4_K, int16_t)
PANEL_PRODUCT(product_q4_k8, PF_Q4_K8, int8_t)
PANEL_PRODUCT(product_iq4_nl8, PF_IQ4_NL8, int8_t)
PANEL_PRODUCT(product_iq4_xs8, PF_IQ4_XS8, int8_t)

/* x [R, K] float32 -> xq [R, K] int8 (x ~ dx * xq per 32 values, rounded to nearest even),
 * dx and xs = dx * sum(xq) [R, K / 32], and o16 [R, K / 16] = 32 * sum(xq) of each 16 values
 * (Q6_K's zero point). A block holding a NaN or an infinity gets codes 0 and dx = xs = NaN:
 * its row's outputs are NaN, as the int16 path gives. */
static void quantize_rows8(const float *x, int64_t R, int64_t K, int8_t *xq, float *dx, float *xs,
                           int32_t *o16) {
    for (int64_t b = 0; b < R * (K / GROUP); b++) {
        const __m512 v0 = _mm512_loadu_ps(x + b * GROUP), v1 = _mm512_loadu_ps(x + b * GROUP + 16);
        const __mmask16 bad =
            _mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
            _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (bad) {
            memset(xq + b * GROUP, 0, GROUP);
            dx[b] = xs[b] = NAN;
            o16[2 * b] = o16[2 * b + 1] = 0;
            continue;
        }
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(int8_code_factor(mx));
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  /* |q| <= 127 */
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        _mm_storeu_si128((__m128i *)(xq + b * GROUP), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + b * GROUP + 16), _mm512_cvtsepi32_epi8(q1));
        const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        dx[b] = mx / 127.f;
        xs[b] = dx[b] * (float)(s0 + s1);
        o16[2 * b] = 32 * s0;
        o16[2 * b + 1] = 32 * s1;
    }
}

/* PF_Q6_K8, rows [0, RB) over one panel (as panel_tile) */
static inline __attribute__((always_inline)) void panel_tile_q6k8(
        int RB, const int8_t *xq, const float *dx, const int32_t *o16, int64_t K,
        const uint8_t *panel, float *y, int64_t N, int cols) {
    const int64_t G = K / GROUP, U = K / 256, UB = unit_bytes(PF_Q6_K8);
    const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    __m512 acc[P_TILE];
    for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < U; u++) {
        const uint8_t *ub = panel + u * UB;
        for (int l = 0; l < UB; l += 64) _mm_prefetch((const char *)ub + P_PF + l, _MM_HINT_T1);
        const __m512 d = f16x16(ub);
        for (int i = 0; i < 8; i++) {
            const int64_t g = u * 8 + i;
            const uint8_t *b = ub + 288 + 384 * i;
            __m512i sa[P_TILE], sb[P_TILE];
            for (int r = 0; r < RB; r++) sa[r] = sb[r] = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) {
                const __m512i H = _mm512_loadu_si512(b + 256 + 64 * h);
                for (int t = 0; t < 2; t++) {
                    const int a = 2 * h + t;
                    const __m512i v = _mm512_loadu_si512(b + 64 * a);
                    /* this register's high bits to bits 4-5 of each byte */
                    const __m512i hl = t ? H : _mm512_slli_epi16(H, 4);
                    const __m512i hu = t ? _mm512_srli_epi16(H, 2) : _mm512_slli_epi16(H, 2);
                    const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, nib),
                                                       _mm512_and_si512(hl, top));
                    const __m512i up = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(v, 4), nib), _mm512_and_si512(hu, top));
                    for (int r = 0; r < RB; r++) {
                        const int8_t *xr = xq + r * K + g * GROUP + 4 * a;
                        sa[r] = _mm512_dpbusd_epi32(sa[r], lo, quad(xr));
                        sb[r] = _mm512_dpbusd_epi32(sb[r], up, quad(xr + 16));
                    }
                }
            }
            /* d * sc of groups 2i and 2i + 1 (inputs 0-15, 16-31 of the block) */
            const __m512 sca = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(ub + 32 + 32 * i)))));
            const __m512 scb = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(ub + 48 + 32 * i)))));
            for (int r = 0; r < RB; r++) {
                const int32_t *o = o16 + r * 2 * G + 2 * g;
                const __m512 fa = _mm512_cvtepi32_ps(_mm512_sub_epi32(sa[r], _mm512_set1_epi32(o[0])));
                const __m512 fb = _mm512_cvtepi32_ps(_mm512_sub_epi32(sb[r], _mm512_set1_epi32(o[1])));
                acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(fb, scb, _mm512_mul_ps(fa, sca)),
                                         _mm512_set1_ps(dx[r * G + g]), acc[r]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < RB; r++) _mm512_mask_storeu_ps(y + r * N, keep, acc[r]);
}

static void product_q6_k8(const int8_t *xq, const float *dx, const int32_t *o16, int64_t R,
                          int64_t K, const uint8_t *panels, int64_t N, float *y, int threads) {
    const int64_t G = K / GROUP, P = (N + P_OUT - 1) / P_OUT;
    const int64_t bytes = K / 256 * unit_bytes(PF_Q6_K8);
    const int64_t tiles = (R + P_TILE - 1) / P_TILE;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t p = 0; p < P; p++) {
        const uint8_t *panel = panels + p * bytes;
        const int cols = N - p * P_OUT < P_OUT ? (int)(N - p * P_OUT) : P_OUT;
        for (int64_t t = 0, r0 = 0, rb; t < tiles; t++, r0 += rb) {
            rb = R / tiles + (t < R % tiles);
            const int8_t *xt = xq + r0 * K;
            const float *dt = dx + r0 * G;
            const int32_t *ot = o16 + r0 * 2 * G;
            float *yt = y + r0 * N + p * P_OUT;
            switch (rb) {
            case 1: panel_tile_q6k8(1, xt, dt, ot, K, panel, yt, N, cols); break;
            case 2: panel_tile_q6k8(2, xt, dt, ot, K, panel, yt, N, cols); break;
            case 3: panel_tile_q6k8(3, xt, dt, ot, K, panel, yt, N, cols); break;
            case 4: panel_tile_q6k8(4, xt, dt, ot, K, panel, yt, N, cols); break;
            case 5: panel_tile_q6k8(5, xt, dt, ot, K, panel, yt, N, cols); break;
            default: panel_tile_q6k8(6, xt, dt, ot, K, panel, yt, N, cols); break;
            }
        }
    }
}

/* x [R, K] float32 (K a multiple of the format's unit), panels of N outputs in format fmt
 * -> y [R, N] float32. Returns 0, -1 when out of memory, -2 for an unknown format or K. */
int panel_linear(const float *x, int64_t R, int64_t K, const uint8_t *panels, int fmt, int64_t N,
                 float *y, int threads) {
    if (fmt < PF_Q4_F32 || fmt > PF_IQ4_XS8 || K % unit_inputs(fmt)) return -2;
    if (R == 0) return 0;
    const int64_t G = K / GROUP;
    if (fmt >= PF_Q4_K8) {  /* int8 activations */
        int8_t *xq = malloc((size_t)(R * K));
        float *dx = malloc(sizeof(float) * R * G), *xs = malloc(sizeof(float) * R * G);
        int32_t *o16 = malloc(sizeof(int32_t) * R * G * 2);
        if (!xq || !dx || !xs || !o16) { free(xq); free(dx); free(xs); free(o16); return -1; }
        quantize_rows8(x, R, K, xq, dx, xs, o16);
        if (fmt == PF_Q4_K8) product_q4_k8(xq, dx, xs, R, K, panels, N, y, threads);
        else if (fmt == PF_IQ4_NL8) product_iq4_nl8(xq, dx, xs, R, K, panels, N, y, threads);
        else if (fmt == PF_IQ4_XS8) product_iq4_xs8(xq, dx, xs, R, K, panels, N, y, threads);
        else product_q6_k8(xq, dx, o16, R, K, panels, N, y, threads);
        free(xq); free(dx); free(xs); free(o16);
        return 0;
    }
    int16_t *xq = malloc(sizeof(int16_t) * R * K);
    float *dx = malloc(sizeof(float) * R * G), *xs8 = malloc(sizeof(float) * R * G * 8);
    float *xs = malloc(sizeof(float) * R * G);
    if (!xq || !dx || !xs8 || !xs) { free(xq); free(dx); free(xs8); free(xs); return -1; }
    quantize_rows(x, R, K, xq, dx, xs8);
    for (int64_t i = 0; i < R * G; i++) {  /* block sums for the min terms */
        const float *s = xs8 + i * 8;
        xs[i] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
    switch (fmt) {
    case PF_Q4_F32: product_q4_f32(xq, dx, xs, R, K, panels, N, y, threads); break;
    case PF_Q4_F16: product_q4_f16(xq, dx, xs, R, K, panels, N, y, threads); break;
    case PF_Q5_F16: product_q5_f16(xq, dx, xs, R, K, panels, N, y, threads); break;
    default: product_q4_k(xq, dx, xs, R, K, panels, N, y, threads); break;
    }
    free(xq); free(dx); free(xs8); free(xs);
    return 0;
}

#else
int panels_available(void) { return 0; }

int panel_linear(const float *x, int64_t R, int64_t K, const uint8_t *panels, int fmt, int64_t N,
                 float *y, int threads) {
    (void)x; (void)R; (void)K; (void)panels; (void)fmt; (void)N; (void)y; (void)threads;
    return -2;
}
#endif
