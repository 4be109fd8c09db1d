/* The native steps of a decoder layer for steps of many rows on CPUs with bf16 units
 * (kernels/cpu_wide_layer.py), around its four oneDNN bf16 products:
 *
 *   h = bf16(norm(x))            rms_norm_bf16
 *   qkv = h Wqkv (bf16)          oneDNN
 *   q, k, v = rotate(qkv + b)    rope_qkv_bf16: q float32 out, k and v into the pool (Qwen3:
 *                                q and k normalized per head before the rotation)
 *   a = attention(q)             the attention backend
 *   o = a Wo (bf16)              oneDNN
 *   x += o; h = bf16(norm(x))    rms_norm_bf16
 *   d = silu(h Wg) * (h Wu) Wd   oneDNN, silu_mul_bf16, oneDNN
 *   x += d
 *
 * The module path computes the same values with ~40 PyTorch ops a layer (float32 <-> bf16
 * conversions around every product, the rotary's muls, roll and add, a bias add, slicing);
 * here each step is one call over all rows, and every value is the module path's: the norm is
 * rms_norm's float32 result rounded to nearest even once (what `.to(bfloat16)` does before a
 * product), the rotation is two rounded products and a rounded sum (no fused multiply-add:
 * PyTorch's mul, mul, add), and K/V are rounded into the pool by store_kv_row as write_kv
 * does. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec_math.h"

void rms_norm(const float *x, const float *add, float *x_out, const float *weight, float *out,
              int64_t T, int64_t D, float eps);
void store_kv_row(void *pool, int64_t index, const float *src, int64_t D, int bf16);
int paged_attention(const float *q, float *out, const void *kc, const void *vc,
                    int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                    const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                    const int32_t *qstart, const int32_t *seqs, int64_t n_seqs,
                    float scale, int threads, int kv_kind);
void q32_quantize_row(const uint16_t *x, int64_t K, int64_t B, const float *inv, int8_t *xq,
                      float *dx, float *sx);
void q32_quantize_f32(const float *x, int64_t R, int64_t K, int64_t B, const float *inv,
                      int8_t *xq, float *dx, float *sx, int threads);
int q32_linear(const int8_t *xq, const float *dx, const float *sx, int64_t R, int64_t K,
               int64_t B, const uint8_t *c, const float *d, const float *m,
               const int32_t *zeros, int nibbles, int64_t N, uint16_t *y, int threads);
int q32_linear_gated_q(const int8_t *xq, const float *dx, const float *sx, int64_t R,
                       int64_t K, int64_t B, const uint8_t *c, const float *d, const float *m,
                       const int32_t *zeros, int nibbles, int64_t N, int8_t *aq, float *adx,
                       float *asx, int64_t Bq, const float *inv, int threads);

static void round_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) store_bf16x8(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static void widen_row(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* x [T, D] float32, updated in place to x + add when add [T, D] bf16 is given; out [T, D]
 * bf16 = rms_norm(x) rounded once; with xq, each row of out also quantized for a q32 product
 * in blocks of B (q32_quantize_row with inv: xq [T, D], dx and sx [T, D / B]) while it is
 * in L1. Returns 0, or -1 when out of memory. */
static int norm_rows(float *x, const uint16_t *add, const float *weight, uint16_t *out,
                     int8_t *xq, float *dx, float *sx, int64_t B, const float *inv, int64_t T,
                     int64_t D, float eps, int threads) {
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && T > 1)
    {
        float *buf = malloc(sizeof(float) * 2 * D);
        if (!buf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!buf) continue;
            float *xr = x + t * D, *delta = buf, *h = buf + D;
            if (add) {
                widen_row(add + t * D, delta, D);
                rms_norm(xr, delta, xr, weight, h, 1, D, eps);
            } else {
                rms_norm(xr, NULL, NULL, weight, h, 1, D, eps);
            }
            round_row(h, out + t * D, D);
            if (xq)
                q32_quantize_row(out + t * D, D, B, inv, xq + t * D, dx + t * (D / B),
                                 sx + t * (D / B));
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

int rms_norm_bf16(float *x, const uint16_t *add, const float *weight, uint16_t *out, int64_t T,
                  int64_t D, float eps, int threads) {
    return norm_rows(x, add, weight, out, NULL, NULL, NULL, 32, NULL, T, D, eps, threads);
}

/* x * cos + roll(x, half) * signed_sin over each head of one row, each product and the sum
 * rounded on its own (no contraction into fused multiply-adds: PyTorch's separate ops). */
__attribute__((optimize("fp-contract=off")))
static void rotate_rounded(float *x, int64_t heads, int64_t hd, const float *cos,
                           const float *ssin) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * hd;
        for (int64_t i = 0; i < half; i++) {
            const float a = xh[i], b = xh[i + half];
            const float a_cos = a * cos[i], b_sin = b * ssin[i];
            const float b_cos = b * cos[i + half], a_sin = a * ssin[i + half];
            xh[i] = a_cos + b_sin;
            xh[i + half] = b_cos + a_sin;
        }
    }
}

/* qkv [T, (H + 2 KVH) hd] bf16 (+ bias float32 when given) -> q [T, H hd] float32, q and k
 * (each head's vector normalized by rms_norm with q_norm / k_norm [hd] first, where given)
 * rotated by their positions' rows of cos / signed_sin [positions, hd]; k and v written to
 * their slots of the head-major pools kc, vc [KVH, NB * BS, row] of kv_kind (store_kv_row:
 * float32, bf16 rounded to nearest even, or int8 codes and a scale a row). Returns 0, or -1
 * when out of memory. */
int rope_qkv_norm_bf16(const uint16_t *qkv, const float *bias, int64_t T, int64_t H,
                       int64_t KVH, int64_t hd, const float *cos, const float *ssin,
                       const int64_t *positions, float *q, void *kc, void *vc, int64_t NB,
                       int64_t BS, const int64_t *slots, int kv_kind, const float *q_norm,
                       const float *k_norm, float eps, int threads) {
    const int64_t nq = H * hd, nkv = KVH * hd, width = nq + 2 * nkv;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1 && T > 1)
    {
        float *row = malloc(sizeof(float) * width);
        if (!row) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!row) continue;
            widen_row(qkv + t * width, row, width);
            if (bias)
                for (int64_t j = 0; j < width; j++) row[j] += bias[j];
            if (q_norm) {
                rms_norm(row, NULL, NULL, q_norm, row, H, hd, eps);
                rms_norm(row + nq, NULL, NULL, k_norm, row + nq, KVH, hd, eps);
            }
            rotate_rounded(row, H + KVH, hd, cos + positions[t] * hd, ssin + positions[t] * hd);
            memcpy(q + t * nq, row, sizeof(float) * nq);
            for (int64_t kh = 0; kh < KVH; kh++) {
                const int64_t dst = kh * NB * BS + slots[t];
                store_kv_row(kc, dst, row + nq + kh * hd, hd, kv_kind);
                store_kv_row(vc, dst, row + nq + nkv + kh * hd, hd, kv_kind);
            }
        }
        free(row);
    }
    return failed ? -1 : 0;
}

int rope_qkv_bf16(const uint16_t *qkv, const float *bias, int64_t T, int64_t H, int64_t KVH,
                  int64_t hd, const float *cos, const float *ssin, const int64_t *positions,
                  float *q, void *kc, void *vc, int64_t NB, int64_t BS, const int64_t *slots,
                  int kv_kind, int threads) {
    return rope_qkv_norm_bf16(qkv, bias, T, H, KVH, hd, cos, ssin, positions, q, kc, vc, NB, BS,
                              slots, kv_kind, NULL, NULL, 0.f, threads);
}

/* A q32 product's weights (layers/q32.py Q32Linear): codes (nibbles: 4-bit, two a byte), d,
 * m of n outputs, and each panel's folded zero (or NULL). */
typedef struct {
    const uint8_t *codes;
    const float *d, *m;
    const int32_t *zeros;
    int64_t nibbles, n, block;  /* block: inputs per scale (q32.Q32Linear.block) */
    const float *inv;  /* the activations' smoothing factors [K] (q32.Q32Linear.inv), or NULL */
} q32_t;

/* A layer whose four products all have q32 forms (kernels/cpu_wide_layer.py WideQ32). */
typedef struct {
    int64_t D, H, KVH, hd, I;
    float eps, scale;
    const float *norm_in, *norm_post, *qkv_bias, *cos, *ssin;
    q32_t qkv, o, gate_up, down;
    const float *q_norm, *k_norm;  /* Qwen3's per-head norms, or NULL */
} wide_q32_t;

/* The whole many-row layer in one call where every product is a q32 one: the steps above
 * and the products in the same order, with each product's activations quantized where they
 * are made (the norms' rows, the attention's float32 output, the gated product's tiles)
 * instead of in passes of their own. Every value is the step-by-step path's. x [T, D] is
 * updated in place; the attention arguments are paged_attention's. With n_out >= 0
 * (out_rows: n_out strictly increasing rows of T; -1: all rows), every row's K and V still go
 * into the pools, but only those rows go on past the attention: their values, the same as
 * with all rows, end in x [0, n_out) (a model's last layer, where the other rows' outputs are
 * never read). Returns 0, or -1 when out of memory. */
int wide_layer_q32(const wide_q32_t *L, float *x, int64_t T, const int64_t *positions,
                   void *kc, void *vc, int64_t NB, int64_t BS, const int64_t *slots,
                   const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                   const int32_t *qstart, const int32_t *seqs, int64_t n_seqs, int kv_kind,
                   const int64_t *out_rows, int64_t n_out, int threads) {
    const int64_t D = L->D, nq = L->H * L->hd, I = L->I;
    const int64_t widest = nq > D ? nq : D;  /* xq holds a norm's rows, then the attention's */
    uint16_t *h = malloc(sizeof(uint16_t) * T * D), *qkv = malloc(sizeof(uint16_t) * T * L->qkv.n);
    uint16_t *y = malloc(sizeof(uint16_t) * T * D);
    float *q = malloc(sizeof(float) * T * nq), *a = malloc(sizeof(float) * T * nq);
    int8_t *xq = malloc((size_t)T * widest), *aq = malloc((size_t)T * I);
    float *dx = malloc(sizeof(float) * T * (widest / 32)), *sx = malloc(sizeof(float) * T * (widest / 32));
    float *adx = malloc(sizeof(float) * T * (I / 32)), *asx = malloc(sizeof(float) * T * (I / 32));
    int rc = -1;
    if (!h || !qkv || !y || !q || !a || !xq || !aq || !dx || !sx || !adx || !asx) goto done;

    if (norm_rows(x, NULL, L->norm_in, h, xq, dx, sx, L->qkv.block, L->qkv.inv, T, D, L->eps,
                  threads))
        goto done;
    if (q32_linear(xq, dx, sx, T, D, L->qkv.block, L->qkv.codes, L->qkv.d, L->qkv.m, L->qkv.zeros,
                   (int)L->qkv.nibbles, L->qkv.n, qkv, threads)) goto done;
    if (rope_qkv_norm_bf16(qkv, L->qkv_bias, T, L->H, L->KVH, L->hd, L->cos, L->ssin, positions,
                           q, kc, vc, NB, BS, slots, kv_kind, L->q_norm, L->k_norm, L->eps,
                           threads)) goto done;
    if (paged_attention(q, a, kc, vc, L->H, L->KVH, L->hd, NB, BS, tables, MB, seq_lens,
                        qstart, seqs, n_seqs, L->scale, threads, kv_kind)) goto done;
    if (n_out >= 0) {  /* only these rows go on: theirs to the front of a and x, in order */
        for (int64_t i = 0; i < n_out; i++)
            if (out_rows[i] != i) {
                memmove(a + i * nq, a + out_rows[i] * nq, sizeof(float) * nq);
                memmove(x + i * D, x + out_rows[i] * D, sizeof(float) * D);
            }
        T = n_out;
    }
    q32_quantize_f32(a, T, nq, L->o.block, L->o.inv, xq, dx, sx, threads);
    if (q32_linear(xq, dx, sx, T, nq, L->o.block, L->o.codes, L->o.d, L->o.m, L->o.zeros,
                   (int)L->o.nibbles, L->o.n, y, threads)) goto done;
    if (norm_rows(x, y, L->norm_post, h, xq, dx, sx, L->gate_up.block, L->gate_up.inv, T, D,
                  L->eps, threads)) goto done;  /* x += o */
    if (q32_linear_gated_q(xq, dx, sx, T, D, L->gate_up.block, L->gate_up.codes, L->gate_up.d,
                           L->gate_up.m, L->gate_up.zeros, (int)L->gate_up.nibbles,
                           L->gate_up.n, aq, adx, asx, L->down.block, L->down.inv, threads))
        goto done;
    if (q32_linear(aq, adx, asx, T, I, L->down.block, L->down.codes, L->down.d, L->down.m, L->down.zeros,
                   (int)L->down.nibbles, L->down.n, y, threads)) goto done;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++)  /* x += d: the bf16 product widened, one float32 add */
        for (int64_t j = 0; j < D; j++) x[t * D + j] += bf16_to_f32(y[t * D + j]);
    rc = 0;
done:
    free(h); free(qkv); free(y); free(q); free(a); free(xq); free(aq); free(dx); free(sx);
    free(adx); free(asx);
    return rc;
}

/* Every layer of a model whose layers are all wide_layer_q32 ones, in order, in one call
 * (kc[l], vc[l]: layer l's pools; out_rows, n_out: the last layer's; the rest as
 * wide_layer_q32's): the per-layer Python and ctypes arguments once a step. Returns 0, or -1
 * when out of memory. */
int wide_layers_q32(const wide_q32_t *const *L, int64_t n_layers, float *x, int64_t T,
                    const int64_t *positions, void *const *kc, void *const *vc, int64_t NB,
                    int64_t BS, const int64_t *slots, const int32_t *tables, int64_t MB,
                    const int32_t *seq_lens, const int32_t *qstart, const int32_t *seqs,
                    int64_t n_seqs, int kv_kind, const int64_t *out_rows, int64_t n_out,
                    int threads) {
    for (int64_t l = 0; l < n_layers; l++) {
        const int last = l == n_layers - 1;
        if (wide_layer_q32(L[l], x, T, positions, kc[l], vc[l], NB, BS, slots, tables, MB,
                           seq_lens, qstart, seqs, n_seqs, kv_kind, out_rows,
                           last ? n_out : -1, threads))
            return -1;
    }
    return 0;
}
