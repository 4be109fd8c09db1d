/* What both few-row GGUF products (cpu_gguf.c: AVX2 and portable; cpu_gguf_avx512.c) share:
 * the block types they take, their sizes, the K-quant 6-bit scales and mins, and one OpenMP
 * product per type around the file's own gguf_row. */
#ifndef PAGELLM_GGUF_TYPES_H
#define PAGELLM_GGUF_TYPES_H
#include <stdint.h>
#include <string.h>
#include "quant_rows.h"

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13,
       T_Q6_K = 14 };

static inline int unit_of(int type) { return type >= T_Q4_K ? 256 : 32; }

static inline int bytes_of(int type) {
    switch (type) {
    case T_Q4_0: return 18; case T_Q4_1: return 20; case T_Q5_0: return 22;
    case T_Q5_1: return 24; case T_Q8_0: return 34; case T_Q4_K: return 144;
    case T_Q5_K: return 176; case T_Q6_K: return 210; default: return 0;
    }
}

/* A Q4_K / Q5_K block's 8 six-bit sub-block scales and mins, byte j of each for sub-block j.
 * The 12 scale bytes as words A, B, C: scales 0-3 = A & 63, mins 0-3 = B & 63, scales 4-7 =
 * C's low nibbles | A's top 2 bits << 4, mins 4-7 = C's high nibbles | B's top 2 bits << 4
 * (ggml's get_scale_min_k4, four bytes at a time). */
static inline void k4_scales_mins(const uint8_t *b, uint64_t *scales, uint64_t *mins) {
    uint32_t w[3];
    memcpy(w, b + 4, 12);
    const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    *scales = (uint64_t)(w[0] & lo6) | (uint64_t)((w[2] & lo4) | (((w[0] >> 6) & lo2) << 4)) << 32;
    *mins = (uint64_t)(w[1] & lo6) | (uint64_t)(((w[2] >> 4) & lo4) | (((w[1] >> 6) & lo2) << 4)) << 32;
}

/* product_T for every type: output features split across OpenMP threads, rows in passes of
 * at most ROW_BLOCK through the including file's gguf_row, with the type a literal inside the
 * loop (the loop body is outlined into a function of its own, where a type passed as an
 * argument would no longer be a constant: decode's switch and the sub-block loops would stay
 * generic, 3x slower). The including file defines GGUF_DX_ROW(T, K) and GGUF_XS_ROW(K): its
 * activation steps and sums per row of x. */
#define GGUF_PRODUCT(T) \
static void product_##T(const int16_t *xq, const float *dx, const float *xs, int64_t R, int64_t K, \
                        const uint8_t *w, int64_t row_bytes, int64_t N, float *y, int threads) { \
    const int64_t dxr = GGUF_DX_ROW(T, K), xsr = GGUF_XS_ROW(K); \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (threads > 1)") \
    for (int64_t n = 0; n < N; n++) { \
        for (int64_t b = 0, r0 = 0, rb; b < ROW_BLOCKS(R); b++, r0 += rb) { \
            rb = ROW_BLOCK_SIZE(R, b); \
            DISPATCH(rb, GGUF_ROWS_##T) \
        } \
    } \
}
#define GGUF_ROWS(T, RB) gguf_row(T, RB, xq + r0 * K, dx + r0 * dxr, xs + r0 * xsr, K, \
                                  w + n * row_bytes, y + r0 * N + n, N)
#define GGUF_ROWS_T_Q4_0(RB) GGUF_ROWS(T_Q4_0, RB)
#define GGUF_ROWS_T_Q4_1(RB) GGUF_ROWS(T_Q4_1, RB)
#define GGUF_ROWS_T_Q5_0(RB) GGUF_ROWS(T_Q5_0, RB)
#define GGUF_ROWS_T_Q5_1(RB) GGUF_ROWS(T_Q5_1, RB)
#define GGUF_ROWS_T_Q8_0(RB) GGUF_ROWS(T_Q8_0, RB)
#define GGUF_ROWS_T_Q4_K(RB) GGUF_ROWS(T_Q4_K, RB)
#define GGUF_ROWS_T_Q5_K(RB) GGUF_ROWS(T_Q5_K, RB)
#define GGUF_ROWS_T_Q6_K(RB) GGUF_ROWS(T_Q6_K, RB)
#define GGUF_PRODUCTS_32 \
    GGUF_PRODUCT(T_Q4_0) GGUF_PRODUCT(T_Q4_1) GGUF_PRODUCT(T_Q5_0) GGUF_PRODUCT(T_Q5_1) \
    GGUF_PRODUCT(T_Q8_0)
#define GGUF_PRODUCTS GGUF_PRODUCTS_32 GGUF_PRODUCT(T_Q4_K) GGUF_PRODUCT(T_Q5_K) GGUF_PRODUCT(T_Q6_K)

/* product_T(args) for the runtime type */
#define GGUF_CALL(type, ...) do { switch (type) { \
    case T_Q4_0: product_T_Q4_0(__VA_ARGS__); break; case T_Q4_1: product_T_Q4_1(__VA_ARGS__); break; \
    case T_Q5_0: product_T_Q5_0(__VA_ARGS__); break; case T_Q5_1: product_T_Q5_1(__VA_ARGS__); break; \
    case T_Q8_0: product_T_Q8_0(__VA_ARGS__); break; case T_Q4_K: product_T_Q4_K(__VA_ARGS__); break; \
    case T_Q5_K: product_T_Q5_K(__VA_ARGS__); break; case T_Q6_K: product_T_Q6_K(__VA_ARGS__); break; \
    } } while (0)
#endif
