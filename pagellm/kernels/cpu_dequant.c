/* Rows of GGUF blocks -> float32, for embedding lookups that keep the file's blocks
 * (pagellm/layers/embedding.py): a step decodes only the rows of its tokens, so an untied
 * embedding table needs no dense copy (Qwen2.5-Coder-1.5B Q4_K_M: 445 MiB of bf16 -> the
 * file's 125 MiB).
 *
 * Each value is computed with gguf-py's operations in its order, in float32, so the rows are
 * those of gguf.quants.dequantize bit for bit:
 *   Q4_0: d * (q - 8)        Q4_1: d * q + m         Q5_0: d * (q - 16)     Q5_1: d * q + m
 *   Q8_0: q * d              Q4_K / Q5_K: (d * sc) * q - dmin * mn       Q6_K: (d * sc) * (q - 32)
 * Scalar code: a decode step looks up one row per sequence. */
#include <stdint.h>
#include <string.h>
#include "gguf_types.h"

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);  /* inf, NaN */
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else {  /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* gguf-py rounds each product before the sum: no fused multiply-adds here (GCC: the attribute;
 * clang ignores it and takes the pragma) */
#ifdef __clang__
#pragma clang fp contract(off)
#endif
#define SEPARATE __attribute__((optimize("fp-contract=off")))

/* one 32-value block b of type t -> y[0..32) */
static SEPARATE void block_32(int t, const uint8_t *b, float *y) {
    const float d = h2f(b);
    if (t == T_Q8_0) {
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    const int has_min = t == T_Q4_1 || t == T_Q5_1, five = t == T_Q5_0 || t == T_Q5_1;
    const float m = has_min ? h2f(b + 2) : 0.f;
    uint32_t qh = 0;
    if (five) memcpy(&qh, b + (has_min ? 4 : 2), 4);
    const uint8_t *qs = b + bytes_of(t) - 16;
    const int zero = t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 0;
    for (int j = 0; j < 32; j++) {
        int q = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
        if (five) q |= ((qh >> j) & 1) << 4;
        y[j] = has_min ? d * (float)q + m : d * (float)(q - zero);
    }
}

/* one 256-value Q4_K / Q5_K / Q6_K block b -> y[0..256) */
static SEPARATE void block_k(int t, const uint8_t *b, float *y) {
    if (t == T_Q6_K) {
        const float d = h2f(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) {  /* 128 values: ql 64 bytes, qh 32 bytes */
            const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
            for (int i = 0; i < 128; i++) {
                const int l = i % 32, quarter = i / 32;  /* quarter: low/high nibble of ql */
                const int lo = (quarter & 1 ? ql[32 + l] : ql[l]) >> (quarter & 2 ? 4 : 0) & 0xF;
                const int q = lo | ((qh[l] >> (2 * quarter)) & 3) << 4;
                const int v = 128 * half + i;
                y[v] = (d * (float)sc[v / 16]) * (float)(q - 32);
            }
        }
        return;
    }
    const float d = h2f(b), dmin = h2f(b + 2);
    uint64_t scales, mins;
    k4_scales_mins(b, &scales, &mins);
    const int five = t == T_Q5_K;
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int s = 0; s < 8; s++) {  /* sub-block s: nibble s % 2 of bytes 32 (s / 2) .. +31 */
        const float ds = d * (float)((scales >> (8 * s)) & 0xFF);
        const float ms = dmin * (float)((mins >> (8 * s)) & 0xFF);
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 0xF;
            if (five) q |= ((qh[l] >> s) & 1) << 4;
            y[32 * s + l] = ds * (float)q - ms;
        }
    }
}

/* out [n, K] float32 = rows ids[0..n) of w (row_bytes per row, K values, type t).
 * Returns 0, or -2 for an unknown type or a K that is not a whole number of blocks. */
int gguf_dequantize_rows(const uint8_t *w, int64_t row_bytes, int t, int64_t K,
                         const int64_t *ids, int64_t n, float *out) {
    const int unit = unit_of(t), size = bytes_of(t);
    if (!size || K % unit || K / unit * size != row_bytes) return -2;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + ids[r] * row_bytes;
        for (int64_t u = 0; u < K / unit; u++) {
            if (unit == 32) block_32(t, row + u * size, out + r * K + u * 32);
            else block_k(t, row + u * size, out + r * K + u * 256);
        }
    }
    return 0;
}
