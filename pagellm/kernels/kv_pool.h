/* The KV pool's row forms, shared by cpu_attention.c (which reads and writes them) and the
 * layers that pass a pool through (cpu_layer.c, cpu_wide_layer.c). A pool is head-major,
 * [KVH, NB, BS, row], one row a slot:
 *   KV_F32:  D float32 values;
 *   KV_BF16: D bf16 values (uint16);
 *   KV_I8:   D int8 codes, then the row's float32 scale s (4 bytes, unaligned): value j is
 *            s * code_j, s = max_j |x_j| / 127, codes rounded to nearest even. Half a bf16
 *            row's bytes plus 4, so a decode step, whose attention streams every key and
 *            value from memory, reads 0.53x the bytes of a bf16 pool at head_dim 64. */
#ifndef PAGELLM_KV_POOL_H
#define PAGELLM_KV_POOL_H
#include <stdint.h>

enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };

/* bytes of one element as pointers step over a row: float32 4, bf16 2, int8 codes 1 */
static inline int64_t kv_elem_bytes(int kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

/* elements (of kv_elem_bytes) from one row to the next */
static inline int64_t kv_row_elems(int kind, int64_t D) { return kind == KV_I8 ? D + 4 : D; }

static inline int64_t kv_row_bytes(int kind, int64_t D) {
    return kv_row_elems(kind, D) * kv_elem_bytes(kind);
}

/* an int8 row's scale */
static inline float kv_i8_scale(const void *row, int64_t D) {
    float s;
    __builtin_memcpy(&s, (const char *)row + D, 4);
    return s;
}
#endif
