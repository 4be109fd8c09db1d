/* Paged attention for every query of a step (decode, speculative verification, prefill
 * chunks) over a KV pool stored head-major, [kv_heads, num_blocks, block_size, row]
 * (pagellm/attention/torch_paged.py), of float32 or bf16 values (bf16: half the bytes a step
 * streams; each value widened to float32 as it is loaded: a 16-bit shift, or with AVX-512 BW
 * an unpack against zeros that leaves the lanes in another order), or int8 codes with a scale
 * a row (kv_pool.h; codes widened to float32 as they are loaded, a key's scale applied to its
 * score and a value's to its probability, so the products stay those of the codes). Queries,
 * scores and outputs are float32, except in a prefill chunk's products over a bf16 pool on a
 * CPU with bf16 dot products (attend_flash: bf16 pairs).
 *
 * Reads each sequence's K/V in place through its block table: no gathered copy of the context
 * and no padding to the longest sequence of the batch. One task per (sequence, KV head) takes
 * the group of query heads that share that KV head, for every query row of the sequence.
 * Tasks go to the threads round robin, each thread with its key-slot and score buffers made
 * once per call; a many-sequence decode step is bound by DRAM latency, so a task's keys are
 * prefetched a block ahead, and while a task scores its keys it sends the thread's next task's
 * keys and values (up to AHEAD_BYTES of each) towards L2, a few lines every four keys.
 * Query row j of sequence s sits at position seq_len - query_len + j and sees keys 0 ..= that position (the causal rule of base.py).
 * Softmax subtracts the row maximum, as torch's does. Prefill chunks (16+ query rows a task)
 * with head_dim 64 or 128 on AVX-512 go by blocks of 64 keys (attend_flash); decode and
 * verification rows keep float32 products, so speculation's verification computes what plain
 * decoding does. On AVX2
 * (head_dim a multiple of 8) the task's query vectors go in tiles of three that stream the
 * visible keys together: scores four keys at a time, a vectorized exp, and the weighted sums
 * of V held in registers (25-37% faster than one vector at a time, 1 to 9 query rows of a
 * 200- or 1000-token context with 3 heads per KV head).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec_math.h"
#include "kv_pool.h"
#include <omp.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Row `slot` of a head's pool (D values) as float32: in place for a float32 pool, widened into
 * tmp for a bf16 or int8 one (int8: the codes times the row's scale). */
static inline const float *kv_row(const void *base, int64_t slot, int64_t D, int kind,
                                  float *tmp) {
    if (kind == KV_F32) return (const float *)base + slot * D;
    if (kind == KV_I8) {
        const int8_t *r = (const int8_t *)base + slot * (D + 4);
        const float s = kv_i8_scale(r, D);
        for (int64_t i = 0; i < D; i++) tmp[i] = s * (float)r[i];
        return tmp;
    }
    const uint16_t *r = (const uint16_t *)base + slot * D;
    for (int64_t i = 0; i < D; i++) tmp[i] = bf16_to_f32(r[i]);
    return tmp;
}

/* bytes of each pool a task sends ahead at most: the next task's first keys and values stay
 * in L2 beside this task's */
#define AHEAD_BYTES (64 * 1024)

/* A thread's next task (its keys, then its values) sent towards L2 a few lines at a time
 * while this task's keys are scored: a whole task of lead time, where a block ahead is about
 * one DRAM latency and leaves a many-sequence decode step waiting on memory. */
typedef struct {
    const char *kbase, *vbase;  /* the next task's KV head in each pool */
    const int32_t *table;       /* its block table */
    int64_t block_bytes;        /* bytes of one block of one head: BS * D * element size */
    int64_t lines;              /* 64-byte lines to send: its blocks' K lines, then V lines */
    int64_t sent;
    const char *at;             /* the next line to send, and where its block ends */
    const char *block_end;
    int64_t block;              /* blocks begun so far, K then V */
} ahead_t;

/* cache lines a block spans (an int8 block of BS * (D + 4) bytes need not fill its last) */
static inline int64_t ahead_lines(int64_t block_bytes) { return (block_bytes + 63) / 64; }

static inline __attribute__((always_inline)) void ahead_send(ahead_t *a, int64_t count) {
    if (!a) return;
    const int64_t end = a->sent + count < a->lines ? a->sent + count : a->lines;
    for (; a->sent < end; a->sent++) {
        if (a->at >= a->block_end) {  /* the next block: K blocks, then the same V blocks */
            const int64_t blocks = a->lines / 2 / ahead_lines(a->block_bytes);
            const int64_t b = a->block < blocks ? a->block : a->block - blocks;
            a->at = (a->block < blocks ? a->kbase : a->vbase) + (int64_t)a->table[b] * a->block_bytes;
            a->block_end = a->at + a->block_bytes;
            a->block++;
        }
        __builtin_prefetch(a->at, 0, 2);
        a->at += 64;
    }
}

/* Lines to send per four keys scored, so that all are sent over n keys */
static inline int64_t ahead_rate(const ahead_t *a, int64_t n) {
    return a && n >= 4 ? (a->lines - a->sent + n / 4 - 1) / (n / 4) : 0;
}

#ifdef __AVX2__
/* Query vectors per tile: each key and value row loaded for a tile serves all of its vectors
 * (the group of heads sharing a KV head, times the sequence's query rows), so K and V stream
 * through the core once per tile, not once per vector (per vector: 0.5 ms a step at a
 * 200-token context, 5 ms at 1000). Three, so that a tile's accumulators stay in registers. */
#define TILE 3

/* 8 values of a K or V row from `off` elements into `base`, as float32 (int8: the codes,
 * unscaled) */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *base, int64_t off,
                                                             int kind) {
    if (kind == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off))), 16));
    if (kind == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)((const int8_t *)base + off))));
    return _mm256_loadu_ps((const float *)base + off);
}

/* The rows of the keys a block (16 keys) ahead on their way into L1 while these are used: a
 * block of the pool is contiguous, but consecutive blocks of a sequence are anywhere (the
 * hardware prefetcher stops at each new block). 64 sequences of 600 tokens, 3 KV heads, one
 * layer: float32 pool 3.5 -> 2.5 ms (24 GB/s, the DRAM's rate), bf16 2.1 ms. */
static inline __attribute__((always_inline)) void prefetch_kv(const void *base, int64_t off,
                                                              int64_t n, int kind) {
    const char *p = (const char *)base + off * kv_elem_bytes(kind);
    for (int64_t c = 0; c < n * kv_elem_bytes(kind); c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

/* The same rows of V into L2 while the scores stream K: the values pass that follows finds
 * them there instead of waiting on DRAM a second time (64 sequences of 96-192 tokens, 3 KV
 * heads, 30 layers, bf16 pool, both cores: 11.7 -> 9.0 ms a step's attention). */
static inline __attribute__((always_inline)) void prefetch_kv_l2(const void *base, int64_t off,
                                                                 int64_t n, int kind) {
    const char *p = (const char *)base + off * kv_elem_bytes(kind);
    for (int64_t c = 0; c < n * kv_elem_bytes(kind); c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
}

/* The factor of a key's (or value's) products at element offset `off`: `scale`, times the
 * row's scale in an int8 pool */
static inline __attribute__((always_inline)) float row_scale(const void *base, int64_t off,
                                                             int64_t D, int kind, float scale) {
    return kind == KV_I8 ? scale * kv_i8_scale((const int8_t *)base + off, D) : scale;
}

/* p[i * L + t] = scale * q_i . k_t for the m vectors q_i and keys t < n, key t's row at
 * kbase + slot[t] (an element offset; D % 8 == 0): four keys at a time, reduced together by
 * horizontal adds.
 * The values of keys from v_from on go towards L2 as the keys are scored (those before were
 * sent ahead by the thread's last task; a task's later tiles: none); `ahead`, the next task's
 * lines, go out over the keys. */
static inline __attribute__((always_inline)) void tile_scores(
        int m, const float *const *q, const void *kbase, const void *vbase, const int64_t *slot, int64_t D,
        int64_t n, float scale, float *p, int64_t L, int kind, int64_t v_from, ahead_t *ahead) {
    const int64_t RS = kv_row_elems(kind, D);
    int64_t t = 0;
    const int64_t rate = ahead_rate(ahead, n);
    for (; t + 4 <= n; t += 4) {
        ahead_send(ahead, rate);
        if (t + 16 < n) {  /* a block ahead */
            prefetch_kv(kbase, slot[t + 16], 4 * RS, kind);
            if (t + 16 >= v_from) prefetch_kv_l2(vbase, slot[t + 16], 4 * RS, kind);
        }
        const int64_t k0 = slot[t], k1 = slot[t + 1];
        const int64_t k2 = slot[t + 2], k3 = slot[t + 3];
        __m256 a[TILE][4];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            const __m256 x0 = load_kv8(kbase, k0 + d, kind), x1 = load_kv8(kbase, k1 + d, kind);
            const __m256 x2 = load_kv8(kbase, k2 + d, kind), x3 = load_kv8(kbase, k3 + d, kind);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
                const __m256 qv = _mm256_loadu_ps(q[i] + d);
                a[i][0] = _mm256_fmadd_ps(qv, x0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qv, x1, a[i][1]);
                a[i][2] = _mm256_fmadd_ps(qv, x2, a[i][2]);
                a[i][3] = _mm256_fmadd_ps(qv, x3, a[i][3]);
            }
        }
        const __m128 sc = _mm_setr_ps(row_scale(kbase, k0, D, kind, scale), row_scale(kbase, k1, D, kind, scale),
                                      row_scale(kbase, k2, D, kind, scale), row_scale(kbase, k3, D, kind, scale));
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            /* [s0 s1 s2 s3] of the low half + the same of the high half */
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]),
                                            _mm256_hadd_ps(a[i][2], a[i][3]));
            const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(p + i * L + t, _mm_mul_ps(sum, sc));
        }
    }
    for (; t < n; t++) {
        const int64_t k = slot[t];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q[i] + d), load_kv8(kbase, k + d, kind), a);
            p[i * L + t] = row_scale(kbase, k, D, kind, scale) * hsum8(a);
        }
    }
}

#ifdef __AVX512F__
/* The same two passes with 512-bit registers where D % 16 == 0: half the instructions per key
 * (a 64-value row is four registers), which is what a many-sequence decode step spends its
 * attention time on once the KV is bf16. */
static inline __attribute__((always_inline)) __m512 load_kv16(const void *base, int64_t off,
                                                              int kind) {
    if (kind == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off))), 16));
    if (kind == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)((const int8_t *)base + off))));
    return _mm512_loadu_ps((const float *)base + off);
}

static inline __m256 fold16(__m512 v) {  /* lanes i and i + 8 added */
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

static inline __attribute__((always_inline)) void tile_scores16(
        int m, const float *const *q, const void *kbase, const void *vbase, const int64_t *slot, int64_t D,
        int64_t n, float scale, float *p, int64_t L, int kind, int64_t v_from, ahead_t *ahead) {
    const int64_t RS = kv_row_elems(kind, D);
    int64_t t = 0;
    const int64_t rate = ahead_rate(ahead, n);
    for (; t + 4 <= n; t += 4) {
        ahead_send(ahead, rate);
        if (t + 16 < n) {  /* a block ahead */
            prefetch_kv(kbase, slot[t + 16], 4 * RS, kind);
            if (t + 16 >= v_from) prefetch_kv_l2(vbase, slot[t + 16], 4 * RS, kind);
        }
        const int64_t k0 = slot[t], k1 = slot[t + 1];
        const int64_t k2 = slot[t + 2], k3 = slot[t + 3];
        __m512 a[TILE][4];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 x0 = load_kv16(kbase, k0 + d, kind), x1 = load_kv16(kbase, k1 + d, kind);
            const __m512 x2 = load_kv16(kbase, k2 + d, kind), x3 = load_kv16(kbase, k3 + d, kind);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
                const __m512 qv = _mm512_loadu_ps(q[i] + d);
                a[i][0] = _mm512_fmadd_ps(qv, x0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(qv, x1, a[i][1]);
                a[i][2] = _mm512_fmadd_ps(qv, x2, a[i][2]);
                a[i][3] = _mm512_fmadd_ps(qv, x3, a[i][3]);
            }
        }
        const __m128 sc = _mm_setr_ps(row_scale(kbase, k0, D, kind, scale), row_scale(kbase, k1, D, kind, scale),
                                      row_scale(kbase, k2, D, kind, scale), row_scale(kbase, k3, D, kind, scale));
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(fold16(a[i][0]), fold16(a[i][1])),
                                            _mm256_hadd_ps(fold16(a[i][2]), fold16(a[i][3])));
            const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(p + i * L + t, _mm_mul_ps(sum, sc));
        }
    }
    for (; t < n; t++) {
        const int64_t k = slot[t];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q[i] + d), load_kv16(kbase, k + d, kind), a);
            p[i * L + t] = row_scale(kbase, k, D, kind, scale) * _mm512_reduce_add_ps(a);
        }
    }
}

static inline __attribute__((always_inline)) void tile_values16(
        int m, const float *p, int64_t L, const float *inv, const void *vbase,
        const int64_t *slot, int64_t D, int64_t n, float *const *out, int kind) {
    const int64_t RS = kv_row_elems(kind, D);
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m512 o[TILE][4];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            o[i][0] = o[i][1] = o[i][2] = o[i][3] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const int64_t v = slot[t] + d0;
            if (d0 == 0 && t + 16 < n) prefetch_kv(vbase, slot[t + 16], RS, kind);
            const __m512 v0 = load_kv16(vbase, v, kind), v1 = load_kv16(vbase, v + 16, kind);
            const __m512 v2 = load_kv16(vbase, v + 32, kind), v3 = load_kv16(vbase, v + 48, kind);
            const float vs = row_scale(vbase, slot[t], D, kind, 1.f);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
                const __m512 w = _mm512_set1_ps(kind == KV_I8 ? p[i * L + t] * vs : p[i * L + t]);
                o[i][0] = _mm512_fmadd_ps(w, v0, o[i][0]);
                o[i][1] = _mm512_fmadd_ps(w, v1, o[i][1]);
                o[i][2] = _mm512_fmadd_ps(w, v2, o[i][2]);
                o[i][3] = _mm512_fmadd_ps(w, v3, o[i][3]);
            }
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            const __m512 s = _mm512_set1_ps(inv[i]);
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(out[i] + d0 + 16 * c, _mm512_mul_ps(o[i][c], s));
        }
    }
    for (; d0 < D; d0 += 16) {
        __m512 o[TILE];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) o[i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m512 v = load_kv16(vbase, slot[t] + d0, kind);
            const float vs = row_scale(vbase, slot[t], D, kind, 1.f);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
                o[i] = _mm512_fmadd_ps(_mm512_set1_ps(kind == KV_I8 ? p[i * L + t] * vs : p[i * L + t]), v, o[i]);
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            _mm512_storeu_ps(out[i] + d0, _mm512_mul_ps(o[i], _mm512_set1_ps(inv[i])));
    }
}

#ifdef __AVX512BW__
/* Decode and verification tiles over a bf16 pool (D % 64 == 0, up to 256) without widening
 * each value into place: unpacking 32 bf16 of a row against zeros (one in-lane shuffle per
 * 16 values) yields float32 lanes in the order of PERM_LO and PERM_HI below, and the query
 * vectors are put in that order once a tile; a row's products are the same float32 products
 * summed in another order, and the outputs are put back in order as they are stored. Where
 * widening took a zero-extension and a shift per 16 values, this takes one shuffle; and
 * scores go eight keys at a time, their eight partial-sum registers reduced by one shuffle
 * tree (three ops a key, against five for four keys' horizontal adds). The default model's
 * 64-row decode step, the two forms alternated step by step in one process: 44.5 -> 43.7 ms
 * (30 layers of 64 sequences' attention alone, every key in L3: 7.5 -> 6.9 ms). */
static const int32_t PERM_LO[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
static const int32_t PERM_HI[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};

/* the 32 values of a bf16 row at `src` as float32, lanes in PERM_LO / PERM_HI order */
static inline __attribute__((always_inline)) void unpack_bf16x32(const uint16_t *src,
                                                                 __m512 *lo, __m512 *hi) {
    const __m512i x = _mm512_loadu_si512((const void *)src), z = _mm512_setzero_si512();
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
}

/* eight registers' sums, in order: s[j] = sum of a[j]'s lanes */
static inline __attribute__((always_inline)) __m256 sum8x16(const __m512 a[8]) {
    __m512 b[4], c[2];
    for (int j = 0; j < 4; j++)  /* lanes [a0.l0+a0.l2, a0.l1+a0.l3, a1.l0+a1.l2, a1.l1+a1.l3] */
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
    for (int j = 0; j < 2; j++)  /* 128-bit lane k: four partial sums of key 4j + k */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
    /* lane k: [two of key k, two of key 4 + k], then [key k, key k, key 4 + k, key 4 + k] */
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    e = _mm512_add_ps(e, _mm512_shuffle_ps(e, e, 0xB1));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, e));
}

/* Before scoring keys [t, t + 8): the look-ahead's share, and the keys a block ahead (row:
 * a row's elements) into L1, their values into L2 once past v_from */
static inline __attribute__((always_inline)) void prefetch8(
        ahead_t *ahead, int64_t rate, const void *kbase, const void *vbase, const int64_t *slot,
        int64_t t, int64_t n, int64_t v_from, int64_t row, int kind) {
    ahead_send(ahead, 2 * rate);
    for (int64_t u = t + 16; u < t + 24 && u < n; u += 4) {
        prefetch_kv(kbase, slot[u], 4 * row, kind);
        if (u >= v_from) prefetch_kv_l2(vbase, slot[u], 4 * row, kind);
    }
}

/* tile_scores16 for a bf16 pool, D % 64 == 0; qp: the m vectors in unpacked order */
static inline __attribute__((always_inline)) void tile_scores_bf16u(
        int m, const float *qp, const void *kbase, const void *vbase, const int64_t *slot,
        int64_t D, int64_t n, float scale, float *p, int64_t L, int64_t v_from, ahead_t *ahead) {
    const uint16_t *K = (const uint16_t *)kbase;
    const int64_t rate = ahead_rate(ahead, n);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        prefetch8(ahead, rate, kbase, vbase, slot, t, n, v_from, D, KV_BF16);
        __m512 a[TILE][8];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) a[i][j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32) {
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
                __m512 lo, hi;
                unpack_bf16x32(K + slot[t + j] + d, &lo, &hi);
                _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
                    a[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + i * D + d), lo, a[i][j]);
                    a[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + i * D + d + 16), hi, a[i][j]);
                }
            }
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            _mm256_storeu_ps(p + i * L + t, _mm256_mul_ps(sum8x16(a[i]), _mm256_set1_ps(scale)));
    }
    for (; t < n; t++) {
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                __m512 lo, hi;
                unpack_bf16x32(K + slot[t] + d, &lo, &hi);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qp + i * D + d), lo, a);
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qp + i * D + d + 16), hi, a);
            }
            p[i * L + t] = scale * _mm512_reduce_add_ps(a);
        }
    }
}

/* tile_scores16 for an int8 pool, D % 16 == 0: eight keys at a time, their partial sums
 * reduced by sum8x16's shuffle tree, each score times its key's scale */
static inline __attribute__((always_inline)) void tile_scores_i8(
        int m, const float *const *q, const void *kbase, const void *vbase, const int64_t *slot,
        int64_t D, int64_t n, float scale, float *p, int64_t L, int64_t v_from, ahead_t *ahead) {
    const int64_t RS = D + 4;
    const int8_t *K = (const int8_t *)kbase;
    const int64_t rate = ahead_rate(ahead, n);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        prefetch8(ahead, rate, kbase, vbase, slot, t, n, v_from, RS, KV_I8);
        __m512 a[TILE][8];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) a[i][j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
                const __m512 x = load_kv16(K, slot[t + j] + d, KV_I8);
                _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
                    a[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q[i] + d), x, a[i][j]);
            }
        }
        float f[8];
        for (int j = 0; j < 8; j++) f[j] = row_scale(K, slot[t + j], D, KV_I8, scale);
        const __m256 sc = _mm256_loadu_ps(f);
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            _mm256_storeu_ps(p + i * L + t, _mm256_mul_ps(sum8x16(a[i]), sc));
    }
    for (; t < n; t++) {
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(q[i] + d), load_kv16(K, slot[t] + d, KV_I8), a);
            p[i * L + t] = row_scale(K, slot[t], D, KV_I8, scale) * _mm512_reduce_add_ps(a);
        }
    }
}

/* tile_values16 for a bf16 pool, D % 64 == 0: outputs gathered in unpacked order, put back
 * in the rows' order as they are stored */
static inline __attribute__((always_inline)) void tile_values_bf16u(
        int m, const float *p, int64_t L, const float *inv, const void *vbase,
        const int64_t *slot, int64_t D, int64_t n, float *const *out) {
    const uint16_t *V = (const uint16_t *)vbase;
    const __m512i back0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 o[TILE][4];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            o[i][0] = o[i][1] = o[i][2] = o[i][3] = _mm512_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            if (d0 == 0 && t + 16 < n) prefetch_kv(vbase, slot[t + 16], D, 1);
            __m512 v[4];
            unpack_bf16x32(V + slot[t] + d0, &v[0], &v[1]);
            unpack_bf16x32(V + slot[t] + d0 + 32, &v[2], &v[3]);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
                const __m512 w = _mm512_set1_ps(p[i * L + t]);
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                    o[i][c] = _mm512_fmadd_ps(w, v[c], o[i][c]);
            }
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            const __m512 s = _mm512_set1_ps(inv[i]);
            _Pragma("GCC unroll 2") for (int c = 0; c < 4; c += 2) {
                _mm512_storeu_ps(out[i] + d0 + 16 * c,
                                 _mm512_mul_ps(_mm512_permutex2var_ps(o[i][c], back0, o[i][c + 1]), s));
                _mm512_storeu_ps(out[i] + d0 + 16 * c + 16,
                                 _mm512_mul_ps(_mm512_permutex2var_ps(o[i][c], back1, o[i][c + 1]), s));
            }
        }
    }
}

/* the m query vectors in unpacked order, D % 32 == 0 */
static inline void unpacked_queries(int m, const float *const *q, int64_t D, float *qp) {
    const __m512i lo = _mm512_loadu_si512((const void *)PERM_LO);
    const __m512i hi = _mm512_loadu_si512((const void *)PERM_HI);
    for (int i = 0; i < m; i++)
        for (int64_t d = 0; d < D; d += 32) {
            const __m512 a = _mm512_loadu_ps(q[i] + d), b = _mm512_loadu_ps(q[i] + d + 16);
            _mm512_storeu_ps(qp + i * D + d, _mm512_permutex2var_ps(a, lo, b));
            _mm512_storeu_ps(qp + i * D + d + 16, _mm512_permutex2var_ps(a, hi, b));
        }
}
#endif
#endif

/* p[0..n) = exp(p - max), returns their sum. */
static float softmax_avx2(float *p, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + t));
    float mx = hmax8(mv);
    for (int64_t u = t; u < n; u++) mx = p[u] > mx ? p[u] : mx;
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), m8));
        _mm256_storeu_ps(p + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum8(sv);
    for (; t < n; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
    return sum;
}

/* out_i[0..D) = inv[i] * sum_t p[i * L + t] v_t over t < n for the m vectors, each output
 * held in registers 32 values at a time while the values stream by once. */
static inline __attribute__((always_inline)) void tile_values(
        int m, const float *p, int64_t L, const float *inv, const void *vbase,
        const int64_t *slot, int64_t D, int64_t n, float *const *out, int kind) {
    const int64_t RS = kv_row_elems(kind, D);
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) {
        __m256 o[TILE][4];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            o[i][0] = o[i][1] = o[i][2] = o[i][3] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const int64_t v = slot[t] + d0;
            if (d0 == 0 && t + 16 < n) prefetch_kv(vbase, slot[t + 16], RS, kind);
            const __m256 v0 = load_kv8(vbase, v, kind), v1 = load_kv8(vbase, v + 8, kind);
            const __m256 v2 = load_kv8(vbase, v + 16, kind), v3 = load_kv8(vbase, v + 24, kind);
            const float vs = row_scale(vbase, slot[t], D, kind, 1.f);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
                const __m256 w = _mm256_set1_ps(kind == KV_I8 ? p[i * L + t] * vs : p[i * L + t]);
                o[i][0] = _mm256_fmadd_ps(w, v0, o[i][0]);
                o[i][1] = _mm256_fmadd_ps(w, v1, o[i][1]);
                o[i][2] = _mm256_fmadd_ps(w, v2, o[i][2]);
                o[i][3] = _mm256_fmadd_ps(w, v3, o[i][3]);
            }
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) {
            const __m256 s = _mm256_set1_ps(inv[i]);
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(out[i] + d0 + 8 * c, _mm256_mul_ps(o[i][c], s));
        }
    }
    for (; d0 < D; d0 += 8) {
        __m256 o[TILE];
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++) o[i] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m256 v = load_kv8(vbase, slot[t] + d0, kind);
            const float vs = row_scale(vbase, slot[t], D, kind, 1.f);
            _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
                o[i] = _mm256_fmadd_ps(_mm256_set1_ps(kind == KV_I8 ? p[i * L + t] * vs : p[i * L + t]), v, o[i]);
        }
        _Pragma("GCC unroll 4") for (int i = 0; i < m; i++)
            _mm256_storeu_ps(out[i] + d0, _mm256_mul_ps(o[i], _mm256_set1_ps(inv[i])));
    }
}

/* softcap > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2's logit soft-capping) */
static inline void soft_cap(float *p, int64_t n, float softcap) {
    const float inv = 1.f / softcap;
    for (int64_t t = 0; t < n; t++) p[t] = softcap * tanhf(p[t] * inv);
}

/* Each vector's softmax over its own keys lo[i] ..< nv[i] (lo NULL: from key 0), the rest of
 * its row of n scores zeroed; inv[i] = 1 / the sum. softcap > 0: the scores capped first. */
static inline void tile_softmax(int m, const int64_t *nv, const int64_t *lo, int64_t n,
                                float *p, int64_t L, float *inv, float softcap) {
    for (int i = 0; i < m; i++) {
        const int64_t a = lo ? lo[i] : 0;
        if (softcap > 0) soft_cap(p + i * L + a, nv[i] - a, softcap);
        inv[i] = 1.f / softmax_avx2(p + i * L + a, nv[i] - a);
        memset(p + i * L, 0, sizeof(float) * a);
        memset(p + i * L + nv[i], 0, sizeof(float) * (n - nv[i]));
    }
}

/* One tile of m query vectors whose last sees n keys (the others fewer, nv[i]; a sliding
 * window's vectors none before lo[i]): scores over n keys, each vector's softmax over its
 * own keys (the rest of its row zeroed), values. */
static inline __attribute__((always_inline)) void attend_tile(
        int m, const float *const *q, float *const *out, const int64_t *nv, const int64_t *lo,
        const void *kbase, const void *vbase, const int64_t *slot, int64_t D, int64_t n,
        float scale, float *p, int64_t L, int kind, int64_t v_from, ahead_t *ahead, float softcap) {
    float inv[TILE];
#ifdef __AVX512BW__
    if (kind == KV_BF16 && D % 64 == 0 && D <= 256) {
        float qp[TILE * 256] __attribute__((aligned(64)));
        unpacked_queries(m, q, D, qp);
        switch (m) {
            case 1: tile_scores_bf16u(1, qp, kbase, vbase, slot, D, n, scale, p, L, v_from, ahead); break;
            case 2: tile_scores_bf16u(2, qp, kbase, vbase, slot, D, n, scale, p, L, v_from, ahead); break;
            default: tile_scores_bf16u(TILE, qp, kbase, vbase, slot, D, n, scale, p, L, v_from, ahead); break;
        }
        tile_softmax(m, nv, lo, n, p, L, inv, softcap);
        switch (m) {
            case 1: tile_values_bf16u(1, p, L, inv, vbase, slot, D, n, out); break;
            case 2: tile_values_bf16u(2, p, L, inv, vbase, slot, D, n, out); break;
            default: tile_values_bf16u(TILE, p, L, inv, vbase, slot, D, n, out); break;
        }
        return;
    }
#endif
#ifdef __AVX512F__
    const int wide = D % 16 == 0;
#else
    const int wide = 0;
#endif
#ifdef __AVX512BW__
#define I8_WIDE (kind == KV_I8 && wide)
#else
#define I8_WIDE 0
#endif
#ifdef __AVX512F__
#define SCORES(M) do { if (I8_WIDE) tile_scores_i8(M, q, kbase, vbase, slot, D, n, scale, p, L, v_from, ahead); \
                       else if (wide) tile_scores16(M, q, kbase, vbase, slot, D, n, scale, p, L, kind, v_from, ahead); \
                       else tile_scores(M, q, kbase, vbase, slot, D, n, scale, p, L, kind, v_from, ahead); } while (0)
#define VALUES(M) do { if (wide) tile_values16(M, p, L, inv, vbase, slot, D, n, out, kind); \
                       else tile_values(M, p, L, inv, vbase, slot, D, n, out, kind); } while (0)
#else
#define SCORES(M) tile_scores(M, q, kbase, vbase, slot, D, n, scale, p, L, kind, v_from, ahead)
#define VALUES(M) tile_values(M, p, L, inv, vbase, slot, D, n, out, kind)
#endif
    switch (m) {
        case 1: SCORES(1); break;
        case 2: SCORES(2); break;
        default: SCORES(TILE); break;
    }
    tile_softmax(m, nv, lo, n, p, L, inv, softcap);
    switch (m) {
        case 1: VALUES(1); break;
        case 2: VALUES(2); break;
        default: VALUES(TILE); break;
    }
#undef SCORES
#undef VALUES
#undef I8_WIDE
}

/* attend_tile for each pool kind, compiled apart */
#define ATTEND_TILE_ARGS int m, const float *const *q, float *const *out, const int64_t *nv, \
        const int64_t *lo, const void *kbase, const void *vbase, const int64_t *slot, int64_t D, int64_t n, \
        float scale, float *p, int64_t L, int64_t v_from, ahead_t *ahead, float softcap
static void attend_tile_f32(ATTEND_TILE_ARGS) {
    attend_tile(m, q, out, nv, lo, kbase, vbase, slot, D, n, scale, p, L, KV_F32, v_from, ahead, softcap);
}

static void attend_tile_bf16(ATTEND_TILE_ARGS) {
    attend_tile(m, q, out, nv, lo, kbase, vbase, slot, D, n, scale, p, L, KV_BF16, v_from, ahead, softcap);
}

static void attend_tile_i8(ATTEND_TILE_ARGS) {
    attend_tile(m, q, out, nv, lo, kbase, vbase, slot, D, n, scale, p, L, KV_I8, v_from, ahead, softcap);
}
#undef ATTEND_TILE_ARGS
#endif

/* Query rows a task takes: a long query (a prefill chunk) splits into tasks of this many
 * rows, so that one sequence's prompt keeps every thread busy (its KV heads alone may be
 * fewer than the threads, or not a multiple of them). */
#define QUERY_ROWS 32
/* query rows from which a task goes by key blocks: prefill chunks, not decode or
 * verification rows (k + 1 of them) */
#define FLASH_MIN_QUERY_ROWS 16

#ifdef __AVX512F__
/* Prefill chunks (many query rows a task) with head_dim 64 or 128: blocks of FB keys at a
 * time, as matrix products. A block's keys are widened once per task into a transposed
 * float32 copy (KT [D][FB]) and its values into a float32 one; then each tile of FM query
 * vectors gets its FB scores from broadcast query values times KT rows (no horizontal sums),
 * a running maximum and sum (the online softmax of flash attention: earlier sums rescaled
 * when the maximum grows) and its outputs in registers while the block's values stream by;
 * a tile computes only the keys of a block its last vector sees. Against three vectors at a
 * time, each dot product summed horizontally (the path of short queries, below): a 2,048-row
 * chunk over 4,000 / 8,000 keys 1.10-1.16x faster (two Zen 5 cores, bf16 pool); one prompt's
 * prefill, default model: 1,000 tokens 1.07x, 4,000 1.13x, 8,000 1.14x. (Scores summed
 * along d in one chain: float32 errors ~2x those of the horizontal sums, ~1e-6 of an output.) */
#define FB 64
/* s[i][c] = q_i . (keys kb0 + 16c .. + 15) for the tile's vectors, chunks c < NC */
static inline __attribute__((always_inline)) void flash_scores(
        int NC, int FM, int m, const float *const *qs, const float *KT, int64_t D,
        __m512 s[6][4]) {
    _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) s[i][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const float *kt = KT + d * FB;
        __m512 k[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) {
            k[c] = _mm512_loadu_ps(kt + 16 * c);
            /* in registers: folded into each FMA as memory operands, the loads outnumbered
             * the FMAs */
            __asm__("" : "+v"(k[c]));
        }
        _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
            if (i >= m) break;
            const __m512 qv = _mm512_set1_ps(qs[i][d]);
            _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++)
                s[i][c] = _mm512_fmadd_ps(qv, k[c], s[i][c]);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* The same scores from bf16 pairs: KTP [D / 2][FB] holds keys' (d, d + 1) pairs, one key a
 * 32-bit lane; qb[i] the vector rounded to bf16; vdpbf16ps multiplies 32 pairs an
 * instruction, twice an FMA's 16 products */
static inline __attribute__((always_inline)) void flash_scores_bf16(
        int NC, int FM, int m, const uint32_t *const *qb, const uint32_t *KTP, int64_t D,
        __m512 s[6][4]) {
    _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) s[i][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        const uint32_t *kt = KTP + p * FB;
        __m512i k[4];
        _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++) {
            k[c] = _mm512_loadu_si512(kt + 16 * c);
            __asm__("" : "+v"(k[c]));
        }
        _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
            if (i >= m) break;
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qb[i][p]);
            _Pragma("GCC unroll 4") for (int c = 0; c < NC; c++)
                s[i][c] = _mm512_dpbf16_ps(s[i][c], qv, (__m512bh)k[c]);
        }
    }
}
#endif

/* Scores of a tile over one key block, its online softmax, and its outputs. BF: the bf16
 * products (KT, Vf hold KTP and VP, qs the bf16 vectors, P is followed by PB: the
 * probabilities rounded to bf16), else float32. */
static inline __attribute__((always_inline)) void flash_tile(
        int D16, int FM, int BF, int m, const void *const *qs, const int64_t *vis,
        const void *KT, const void *Vf, int64_t kb0, int64_t nk, float scale, float *mrow,
        float *lrow, float *const *o, float *P) {
    const int64_t D = 16 * D16;
    /* keys of the block the tile's last (most seeing) vector sees: the rest is not computed */
    const int64_t seen = vis[m - 1] - kb0 < nk ? vis[m - 1] - kb0 : nk;
    __m512 s[6][4];
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SCORES(NC) do { if (BF) flash_scores_bf16(NC, FM, m, (const uint32_t *const *)qs, \
                            (const uint32_t *)KT, D, s); \
                        else flash_scores(NC, FM, m, (const float *const *)qs, \
                            (const float *)KT, D, s); } while (0)
#else
#define SCORES(NC) flash_scores(NC, FM, m, (const float *const *)qs, (const float *)KT, D, s)
#endif
    switch ((seen + 15) / 16) {
        case 1: SCORES(1); break;
        case 2: SCORES(2); break;
        case 3: SCORES(3); break;
        default: SCORES(4); break;
    }
#undef SCORES
    /* masks, the running maximum and sum, probabilities into P */
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    float alpha[6];
    _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
        if (i >= m) break;
        /* key kb0 + t is seen iff t < nk and kb0 + t < vis[i] */
        const int64_t lim = (vis[i] - kb0 < nk ? vis[i] - kb0 : nk);
        __mmask16 k[4];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            k[c] = _mm512_cmp_ps_mask(lane, _mm512_set1_ps((float)(lim - 16 * c)), _CMP_LT_OQ);
            s[i][c] = _mm512_mul_ps(s[i][c], _mm512_set1_ps(scale));
            mx = _mm512_mask_max_ps(mx, k[c], mx, s[i][c]);
        }
        const float mnew = fmaxf(mrow[i], _mm512_reduce_max_ps(mx));
        alpha[i] = mrow[i] == -INFINITY ? 0.f : expf(mrow[i] - mnew);
        mrow[i] = mnew;
        __m512 sum = _mm512_setzero_ps(), e[4];
        const __m512 mv = _mm512_set1_ps(mnew);
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            e[c] = _mm512_maskz_mov_ps(k[c], exp16(_mm512_sub_ps(s[i][c], mv)));
            _mm512_storeu_ps(P + i * FB + 16 * c, e[c]);
            sum = _mm512_add_ps(sum, e[c]);
        }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (BF) {  /* PB [FM][FB] bf16 after P's FM rows */
            uint16_t *pb = (uint16_t *)(P + FM * FB) + i * FB;
            _mm512_storeu_si512(pb, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
            _mm512_storeu_si512(pb + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
        }
#endif
        lrow[i] = lrow[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    }
    /* outputs: o_i = alpha_i o_i + sum_t P[i][t] v_t, held in registers (FM * D16 <= 24) */
    __m512 acc[6][8];
    _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
        if (i >= m) break;
        const __m512 a = _mm512_set1_ps(alpha[i]);
        _Pragma("GCC unroll 8") for (int c = 0; c < D16; c++)
            acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o[i] + 16 * c), a);
    }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (BF) {
        /* keys in pairs (t, t + 1): VP [FB / 2][2D] bf16 holds each pair's rows interleaved
         * (unpacklo / unpackhi of the two rows: outputs in that lane order, put back in
         * order by attend_flash at the end); PB the probabilities' pairs */
        const uint16_t *VP = (const uint16_t *)Vf;
        const uint32_t *PB = (const uint32_t *)(P + FM * FB);
        for (int64_t t2 = 0; t2 < (seen + 1) / 2; t2++) {
            const uint16_t *v = VP + t2 * 2 * D;
            __m512i vv[8];
            _Pragma("GCC unroll 8") for (int c = 0; c < D16; c++) {
                vv[c] = _mm512_loadu_si512(v + 32 * c);
                __asm__("" : "+v"(vv[c]));
            }
            _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
                if (i >= m) break;
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)PB[i * (FB / 2) + t2]);
                _Pragma("GCC unroll 8") for (int c = 0; c < D16; c++)
                    acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w, (__m512bh)vv[c]);
            }
        }
    } else
#endif
    for (int64_t t = 0; t < seen; t++) {
        const float *v = (const float *)Vf + t * D;
        __m512 vv[8];
        _Pragma("GCC unroll 8") for (int c = 0; c < D16; c++) {
            vv[c] = _mm512_loadu_ps(v + 16 * c);
            __asm__("" : "+v"(vv[c]));
        }
        _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
            if (i >= m) break;
            const __m512 w = _mm512_set1_ps(P[i * FB + t]);
            _Pragma("GCC unroll 8") for (int c = 0; c < D16; c++)
                acc[i][c] = _mm512_fmadd_ps(w, vv[c], acc[i][c]);
        }
    }
    _Pragma("GCC unroll 6") for (int i = 0; i < FM; i++) {
        if (i >= m) break;
        _Pragma("GCC unroll 8") for (int c = 0; c < D16; c++)
            _mm512_storeu_ps(o[i] + 16 * c, acc[i][c]);
    }
}

/* One task by key blocks (see flash_tile). buf: FLASH_FLOATS(D, rows) floats. With a bf16
 * pool on a CPU with bf16 dot products, the products take the pool's bf16 values as they are
 * and the query vectors and probabilities rounded to bf16 (as a bf16 model's attention
 * multiplies them): twice the products an instruction. */
#define FLASH_FLOATS(D, rows) (2 * FB * (D) + (rows) * ((D) + 2) + (rows) * (D) / 2 + 12 * FB)
static void attend_flash(const float *q, float *out, const void *kbase, const void *vbase,
                         int64_t H, int64_t D, int64_t group, const int64_t *slot, int64_t L,
                         int64_t q0, int64_t ql, int64_t kvh, float scale, int kind, float *buf) {
    const int64_t rows = ql * group, D16 = D / 16, FM = D16 == 4 ? 6 : 3;
    float *KT = buf, *Vf = KT + FB * D, *O = Vf + FB * D, *mrow = O + rows * D;
    float *lrow = mrow + rows, *QB = lrow + rows, *P = QB + rows * D / 2;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int BF = kind == KV_BF16;
#else
    const int BF = 0;
#endif
    for (int64_t v = 0; v < rows; v++) mrow[v] = -INFINITY, lrow[v] = 0.f;
    memset(O, 0, sizeof(float) * rows * D);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (BF)  /* the query vectors in bf16, once per task */
        for (int64_t v = 0; v < rows; v++) {
            const float *qv = q + ((q0 + v / group) * H + kvh * group + v % group) * D;
            uint16_t *qb = (uint16_t *)QB + v * D;
            for (int64_t c = 0; c < D; c += 32)
                _mm512_storeu_si512(qb + c, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(qv + c + 16), _mm512_loadu_ps(qv + c)));
        }
#endif
    const int64_t first_pos = L - ql;  /* row j sees keys 0 ..= first_pos + j */
    for (int64_t kb0 = 0; kb0 < L; kb0 += FB) {
        const int64_t nk = L - kb0 < FB ? L - kb0 : FB;
        const int64_t j0 = kb0 > first_pos ? kb0 - first_pos : 0;  /* first row seeing kb0 */
        if (j0 >= ql) break;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        if (BF) {
            /* keys' (d, d + 1) pairs transposed: KTP [D / 2][FB]; value rows interleaved in
             * pairs of keys: VP [FB / 2][2D] (zero past nk) */
            uint32_t *KTP = (uint32_t *)KT;
            uint16_t *VP = (uint16_t *)Vf;
            for (int64_t t = 0; t < FB; t++) {
                const uint32_t *kr = (const uint32_t *)((const uint16_t *)kbase + (t < nk ? slot[kb0 + t] : 0));
                for (int64_t p = 0; p < D / 2; p++) KTP[p * FB + t] = t < nk ? kr[p] : 0u;
            }
            for (int64_t t = 0; t < FB; t += 2) {
                uint16_t *dst = VP + (t / 2) * 2 * D;
                const uint16_t *a = (const uint16_t *)vbase + (t < nk ? slot[kb0 + t] : 0);
                const uint16_t *b = (const uint16_t *)vbase + (t + 1 < nk ? slot[kb0 + t + 1] : 0);
                for (int64_t c = 0; c < D; c += 32) {
                    const __m512i va = t < nk ? _mm512_loadu_si512(a + c) : _mm512_setzero_si512();
                    const __m512i vb = t + 1 < nk ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
                    _mm512_storeu_si512(dst + 2 * c, _mm512_unpacklo_epi16(va, vb));
                    _mm512_storeu_si512(dst + 2 * c + 32, _mm512_unpackhi_epi16(va, vb));
                }
            }
        } else
#endif
        /* this block's keys, transposed, and values, as float32 (zero past nk) */
        for (int64_t t = 0; t < FB; t++) {
            float *vr = Vf + t * D;
            if (t >= nk) {
                for (int64_t d = 0; d < D; d++) KT[d * FB + t] = 0.f;
                memset(vr, 0, sizeof(float) * D);
                continue;
            }
            const int64_t off = slot[kb0 + t];
            /* an int8 pool's codes times their row's scale */
            const __m512 ks = _mm512_set1_ps(kind == KV_I8 ? kv_i8_scale((const int8_t *)kbase + off, D) : 1.f);
            const __m512 vs = _mm512_set1_ps(kind == KV_I8 ? kv_i8_scale((const int8_t *)vbase + off, D) : 1.f);
            for (int64_t c = 0; c < D; c += 16) {
                __m512 kv = load_kv16(kbase, off + c, kind), vv = load_kv16(vbase, off + c, kind);
                if (kind == KV_I8) kv = _mm512_mul_ps(kv, ks), vv = _mm512_mul_ps(vv, vs);
                float tmp[16];
                _mm512_storeu_ps(tmp, kv);
                for (int e = 0; e < 16; e++) KT[(c + e) * FB + t] = tmp[e];
                _mm512_storeu_ps(vr + c, vv);
            }
        }
        for (int64_t v0 = j0 * group; v0 < rows; v0 += FM) {
            const void *qs[6];
            float *os[6];
            int64_t vis[6];
            int m = 0;
            for (int64_t v = v0; v < rows && m < FM; v++, m++) {
                const int64_t j = v / group;
                qs[m] = BF ? (const void *)((const uint16_t *)QB + v * D)
                           : (const void *)(q + ((q0 + j) * H + kvh * group + v % group) * D);
                os[m] = O + v * D;
                vis[m] = first_pos + j + 1;
            }
#define TILE_ARGS m, qs, vis, KT, Vf, kb0, nk, scale, mrow + v0, lrow + v0, os, P
            if (D16 == 4) {
                if (BF) flash_tile(4, 6, 1, TILE_ARGS);
                else flash_tile(4, 6, 0, TILE_ARGS);
            } else {
                if (BF) flash_tile(8, 3, 1, TILE_ARGS);
                else flash_tile(8, 3, 0, TILE_ARGS);
            }
#undef TILE_ARGS
        }
    }
    /* bf16 outputs are in unpack order: 16-lane registers c = 2h (lo) and 2h + 1 (hi) hold
     * dims 32h + {0-3, 8-11, 16-19, 24-27} and 32h + {4-7, 12-15, 20-23, 28-31} */
    const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i second16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t v = 0; v < rows; v++) {
        const int64_t j = v / group;
        float *dst = out + ((q0 + j) * H + kvh * group + v % group) * D;
        if (lrow[v] == 0.f) { memset(dst, 0, sizeof(float) * D); continue; }  /* sees no key */
        const __m512 inv = _mm512_set1_ps(1.f / lrow[v]);
        const float *o = O + v * D;
        if (BF) {
            for (int64_t c = 0; c < D; c += 32) {
                const __m512 lo = _mm512_loadu_ps(o + c), hi = _mm512_loadu_ps(o + c + 16);
                _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first16, hi), inv));
                _mm512_storeu_ps(dst + c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second16, hi), inv));
            }
        } else {
            for (int64_t c = 0; c < D; c += 16)
                _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), inv));
        }
    }
}
#endif

/* One (sequence, KV head) task: the query rows of the `group` heads sharing the KV head, for
 * each of the sequence's ql query rows. kc, vc: pools of `kind` (kv_pool.h). window > 0: a
 * sliding window, each row seeing only its last `window` positions (itself included), as
 * Gemma's local layers. softcap > 0: scores capped to softcap * tanh(s / softcap) before the
 * softmax (Gemma 2; the tiles, not the flash path). */
static int attend(const float *q, float *out, const void *kc, const void *vc, int64_t H,
                  int64_t KVH, int64_t D, int64_t NB, int64_t BS, const int32_t *table,
                  int64_t L, int64_t q0, int64_t ql, int64_t kvh, float scale, int kind,
                  int64_t *slot, float *scores, float *flash_buf, int64_t v_sent, ahead_t *ahead,
                  int64_t window, float softcap) {
    const int64_t group = H / KVH, rows = ql * group;
    const void *kbase = (const char *)kc + kvh * NB * BS * kv_row_bytes(kind, D);
    const void *vbase = (const char *)vc + kvh * NB * BS * kv_row_bytes(kind, D);
#ifdef __AVX2__
    if (D % 8 == 0) {
        /* each key's row (its element offset) once per task, not per key and row (a block's
         * keys are consecutive slots: no division per key); TILE rows of scores in p */
        const int64_t RS = kv_row_elems(kind, D);
        /* a window: the task's first row sees nothing before key `first`; slot[] starts there */
        const int64_t first = window > 0 && L - ql - window + 1 > 0 ? L - ql - window + 1 : 0;
        if (first == 0) {
            for (int64_t t = 0, b = 0; t < L; b++) {
                const int64_t start = (int64_t)table[b] * BS;
                for (int64_t i = 0; i < BS && t < L; i++, t++) slot[t] = (start + i) * RS;
            }
        } else {
            for (int64_t t = first; t < L; t++) slot[t - first] = ((int64_t)table[t / BS] * BS + t % BS) * RS;
            v_sent = 0, ahead = NULL;  /* what was sent ahead began at key 0 */
        }
        const int windowed = window > 0 && L > window;  /* some row does not see every key */
#ifdef __AVX512F__
        if (flash_buf && ql >= FLASH_MIN_QUERY_ROWS && (D == 64 || D == 128) && !windowed
                && !(softcap > 0)) {
            attend_flash(q, out, kbase, vbase, H, D, group, slot, L, q0, ql, kvh, scale, kind,
                         flash_buf);
            return 0;
        }
#endif
        float *p = scores;
        /* vectors in order of query row (each sees one key more than the row before), head */
        for (int64_t v0 = 0; v0 < rows; v0 += TILE) {
            const float *qs[TILE];
            float *outs[TILE];
            int64_t nv[TILE], lo[TILE];
            int m = 0;
            for (int64_t v = v0; v < rows && m < TILE; v++) {
                const int64_t j = v / group, n = L - ql + j + 1;  /* keys 0 ..= its position */
                const int64_t row = (q0 + j) * H + kvh * group + v % group;
                if (n <= 0) { memset(out + row * D, 0, sizeof(float) * D); continue; }
                /* counted from slot[0], key `first`; a window's row from n - window on */
                lo[m] = windowed && n - window > first ? n - window - first : 0;
                qs[m] = q + row * D, outs[m] = out + row * D, nv[m++] = n - first;
            }
            /* the first tile's scores bring the values towards L2 too; later tiles find them
             * there (prefetching them again made a 1,952-row chunk over 4,000 keys ~12% slower) */
            if (m)
                (kind == KV_BF16 ? attend_tile_bf16 : kind == KV_I8 ? attend_tile_i8
                                 : attend_tile_f32)(m, qs, outs, nv, windowed ? lo : NULL,
                                                    kbase, vbase, slot, D,
                                                    nv[m - 1], scale, p, L,
                                                    v0 == 0 ? v_sent : INT64_MAX,
                                                    v0 == 0 ? ahead : NULL, softcap);
        }
        return 0;
    }
#endif
    (void)slot; (void)scores; (void)flash_buf;
    /* scores [rows, L], then probabilities in place */
    float *p = malloc(sizeof(float) * rows * (L > 0 ? L : 1)), *tmp = malloc(sizeof(float) * D);
    if (!p || !tmp) { free(p); free(tmp); return -1; }
    for (int64_t t = 0; t < L; t++) {
        const float *k = kv_row(kbase, table[t / BS] * BS + t % BS, D, kind, tmp);
        for (int64_t j = 0; j < ql; j++) {
            const int64_t visible = L - ql + j;  /* last key position row j sees */
            const int seen = t <= visible && (window <= 0 || visible - t < window);
            for (int64_t g = 0; g < group; g++) {
                const float *qr = q + ((q0 + j) * H + kvh * group + g) * D;
                const float sc = seen ? scale * dot(qr, k, D) : -INFINITY;
                p[(j * group + g) * L + t] = seen && softcap > 0 ? softcap * tanhf(sc / softcap) : sc;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *pr = p + r * L, mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < L; t++) mx = pr[t] > mx ? pr[t] : mx;
        for (int64_t t = 0; t < L; t++) { pr[t] = expf(pr[t] - mx); sum += pr[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; t++) pr[t] *= inv;
    }
    for (int64_t j = 0; j < ql; j++)
        for (int64_t g = 0; g < group; g++)
            memset(out + ((q0 + j) * H + kvh * group + g) * D, 0, sizeof(float) * D);
    for (int64_t t = 0; t < L; t++) {
        const float *v = kv_row(vbase, table[t / BS] * BS + t % BS, D, kind, tmp);
        for (int64_t j = 0; j < ql; j++) {
            if (t > L - ql + j || (window > 0 && L - ql + j - t >= window)) continue;
            for (int64_t g = 0; g < group; g++)
                axpy(out + ((q0 + j) * H + kvh * group + g) * D, p[(j * group + g) * L + t], v, D);
        }
    }
    free(p); free(tmp);
    return 0;
}

#ifndef TILE
#define TILE 1  /* rows of a thread's score buffer (the AVX2 tiles' query vectors) */
#endif

/* The first block of K and V rows of sequence s under KV head kvh (every task of a sequence
 * reads from key 0), towards L2. */
static void prefetch_task(const void *kc, const void *vc, int64_t D, int64_t NB, int64_t BS,
                          const int32_t *tables, int64_t MB, const int32_t *seq_lens, int64_t s,
                          int64_t kvh, int kind) {
    if (seq_lens[s] <= 0) return;
    const int64_t rb = kv_row_bytes(kind, D);
    const int64_t off = (kvh * NB * BS + (int64_t)tables[s * MB] * BS) * rb;
    for (int64_t c = 0; c < BS * rb; c += 64) {
        __builtin_prefetch((const char *)kc + off + c, 0, 2);
        __builtin_prefetch((const char *)vc + off + c, 0, 2);
    }
}

/* Keys a task (sequence s, query rows from c) reads: rows c .. c + n of the query are the
 * last n of the sequence cut after them. */
static inline int64_t task_keys(const int32_t *qstart, const int32_t *seq_lens, int64_t s,
                                int64_t c) {
    const int64_t ql = qstart[s + 1] - qstart[s];
    const int64_t n = ql - c < QUERY_ROWS ? ql - c : QUERY_ROWS;
    return seq_lens[s] - (ql - c - n);
}

/* q, out [T, H, D]; kc, vc [KVH, NB, BS, row] pools of kv_kind (kv_pool.h);
 * tables [S, MB]; seq_lens [S]; qstart [S + 1]; seqs [n_seqs]: the sequences to attend for
 * (the others are left alone in out); window > 0: each row sees its last `window` positions
 * only (0: all before it). Returns 0, or -1 when out of memory. */
int paged_attention_window(const float *q, float *out, const void *kc, const void *vc,
                           int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                           const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                           const int32_t *qstart, const int32_t *seqs, int64_t n_seqs,
                           float scale, int threads, int kv_kind, int64_t window, float softcap) {
    /* tasks: (sequence, first query row of a chunk), times the KV heads */
    int64_t n_tasks = 0;
    int chunks = 0;  /* a prefill chunk among the sequences: the key-block buffers are needed */
    for (int64_t i = 0; i < n_seqs; i++) {
        const int64_t ql = qstart[seqs[i] + 1] - qstart[seqs[i]];
        n_tasks += ql > QUERY_ROWS ? (ql + QUERY_ROWS - 1) / QUERY_ROWS : 1;
        chunks |= ql >= FLASH_MIN_QUERY_ROWS;
    }
    int64_t *task = malloc(sizeof(int64_t) * 2 * (n_tasks > 0 ? n_tasks : 1));
    if (!task) return -1;
    for (int64_t i = 0, t = 0; i < n_seqs; i++) {
        const int64_t ql = qstart[seqs[i] + 1] - qstart[seqs[i]];
        for (int64_t c = 0; c == 0 || c < ql; c += QUERY_ROWS, t++)
            task[2 * t] = seqs[i], task[2 * t + 1] = c;
    }
    int64_t longest = 1;  /* keys of the longest sequence: the size of a thread's buffers */
    for (int64_t i = 0; i < n_seqs; i++)
        longest = seq_lens[seqs[i]] > longest ? seq_lens[seqs[i]] : longest;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* a thread's key slots and TILE rows of scores, once per call (not per task) */
        int64_t *slot = malloc(sizeof(int64_t) * longest);
        float *p = malloc(sizeof(float) * TILE * longest);
#ifdef __AVX512F__
        float *fb = chunks ? malloc(sizeof(float) * FLASH_FLOATS(D, QUERY_ROWS * (H / KVH))) : NULL;
#else
        float *fb = NULL;
        (void)chunks;
#endif
        if (!slot || !p) {
            #pragma omp atomic write
            failed = 1;
        }
        /* task i of a thread is followed by its task i + threads (static, round robin):
         * its first block starts on its way to L2 before this one is attended (64 sequences
         * of 96-192 tokens, 30 layers, both cores: 9.7 -> 8.6 ms), and the rest of its lines
         * (`ahead`) while this one's keys are scored (64 sequences of 192 tokens in scattered
         * blocks, 30 layers, both cores, the two builds alternated in one process: 24.3 ->
         * 17.9 ms; 16 of 500 tokens 11.1 -> 9.0; one of 200 level; the default model's
         * 64-row decode step ~9% faster) */
        const int64_t n_all = n_tasks * KVH, stride = omp_get_num_threads();
        int64_t v_sent = 0;  /* keys of this task whose values the last one sent ahead */
        #pragma omp for schedule(static, 1)
        for (int64_t i = 0; i < n_all; i++) {
            ahead_t ahead = {0};
            int64_t ahead_keys = 0;
            if (i + stride < n_all) {
                prefetch_task(kc, vc, D, NB, BS, tables, MB, seq_lens, task[2 * ((i + stride) / KVH)],
                              (i + stride) % KVH, kv_kind);
                const int64_t tn = (i + stride) / KVH, hn = (i + stride) % KVH, sn = task[2 * tn];
                const int64_t block_bytes = BS * kv_row_bytes(kv_kind, D);
                const int64_t cap = AHEAD_BYTES / block_bytes > 1 ? AHEAD_BYTES / block_bytes : 1;
                int64_t blocks = (task_keys(qstart, seq_lens, sn, task[2 * tn + 1]) + BS - 1) / BS;
                blocks = blocks < 0 ? 0 : blocks < cap ? blocks : cap;
                ahead = (ahead_t){(const char *)kc + hn * NB * block_bytes,
                                  (const char *)vc + hn * NB * block_bytes, tables + sn * MB,
                                  block_bytes, 2 * blocks * ahead_lines(block_bytes), 0, NULL, NULL, 0};
                ahead_keys = blocks * BS;
            }
            const int64_t t = i / KVH, kvh = i % KVH;
            const int64_t s = task[2 * t], c = task[2 * t + 1], q0 = qstart[s];
            const int64_t ql = qstart[s + 1] - q0;
            const int64_t n = ql - c < QUERY_ROWS ? ql - c : QUERY_ROWS;
            const int64_t len = task_keys(qstart, seq_lens, s, c);
            if (slot && p && attend(q, out, kc, vc, H, KVH, D, NB, BS, tables + s * MB, len,
                                    q0 + c, n, kvh, scale, kv_kind, slot, p, fb, v_sent, &ahead,
                                    window, softcap)) {
                #pragma omp atomic write
                failed = 1;
            }
            v_sent = ahead.lines && ahead.sent == ahead.lines ? ahead_keys : 0;
        }
        free(slot); free(p); free(fb);
    }
    free(task);
    return failed ? -1 : 0;
}

/* paged_attention_window without a window or soft-capping (the many-row C layer's calls) */
int paged_attention(const float *q, float *out, const void *kc, const void *vc,
                    int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                    const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                    const int32_t *qstart, const int32_t *seqs, int64_t n_seqs,
                    float scale, int threads, int kv_kind) {
    return paged_attention_window(q, out, kc, vc, H, KVH, D, NB, BS, tables, MB, seq_lens,
                                  qstart, seqs, n_seqs, scale, threads, kv_kind, 0, 0.f);
}

/* One row of D values into row `index` of a pool of `kind`: float32 as they are, bf16
 * rounded to nearest even, int8 as codes round(x / s) (to nearest even) and s = max |x| / 127
 * (0 for a row of zeros, codes 0 where max |x| < 127 / FLT_MAX; a row holding a NaN or an infinity gets a NaN scale, so that what
 * attends to it is NaN, as with the other kinds). */
void store_kv_row(void *pool, int64_t index, const float *src, int64_t D, int kind) {
    if (kind == KV_F32) { memcpy((float *)pool + index * D, src, sizeof(float) * D); return; }
    if (kind == KV_BF16) {
        uint16_t *dst = (uint16_t *)pool + index * D;
        for (int64_t i = 0; i < D; i++) dst[i] = f32_to_bf16(src[i]);
        return;
    }
    int8_t *dst = (int8_t *)pool + index * (D + 4);
    float mx = 0.f;
    int finite = 1;
    for (int64_t i = 0; i < D; i++) {
        finite &= isfinite(src[i]) != 0;
        mx = fabsf(src[i]) > mx ? fabsf(src[i]) : mx;
    }
    const float s = finite ? mx / 127.f : NAN, inv = finite ? int8_code_factor(mx) : 0.f;
    int64_t i = 0;
#ifdef __AVX512F__
    /* the same roundings 16 at a time (cvtps rounds to nearest even, as nearbyintf does) */
    for (; i + 16 <= D; i += 16)
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(
            _mm512_mul_ps(_mm512_loadu_ps(src + i), _mm512_set1_ps(inv)))));
#endif
    for (; i < D; i++) {
        const float r = finite ? nearbyintf(src[i] * inv) : 0.f;  /* |r| <= 127 */
        dst[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    }
    if (!finite) memset(dst, 0, D);
    memcpy(dst + D, &s, 4);
}

/* k, v [T, KVH, D] float32 -> slots of the head-major pools kc, vc [KVH, NB * BS, row] of
 * kv_kind (kv_pool.h). */
void write_kv(const float *k, const float *v, void *kc, void *vc, const int64_t *slots,
              int64_t T, int64_t KVH, int64_t D, int64_t slots_per_head, int kv_kind) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t dst = h * slots_per_head + slots[t], src = (t * KVH + h) * D;
            store_kv_row(kc, dst, k + src, D, kv_kind);
            store_kv_row(vc, dst, v + src, D, kv_kind);
        }
}
