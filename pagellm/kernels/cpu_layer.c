/* One Llama decoder layer for a step of a few rows (decode, speculative verification), as a
 * single call: the same kernels the PyTorch modules call one by one (RMSNorm, Q4 products,
 * paged attention), plus rotary embedding and SiLU-gating written here. At batch 1 the ~25
 * module and op dispatches per layer cost about as much as the layer's arithmetic.
 *
 *   h = norm(x); q, k, v = h Wqkv; rotate q, k; write k, v; a = attention(q);
 *   x += a Wo; h = norm(x); g, u = h Wgu; x += (silu(g) * u) Wdown
 *
 * decode_layer_ext's layer_ext_t adds what Qwen3 and Gemma 3 layers do besides: q and k
 * normalized per head before the rotation, a sliding window, the attention's and the MLP's
 * outputs normalized before their residual adds, GELU (tanh) gating.
 *
 * Everything is float32 but the KV pool (of kv_kind: float32, bf16 or int8, kv_pool.h); x [T, D]
 * is updated in place. Returns 0, or -1 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec_math.h"

int q4_linear(const float *x, int64_t R, int64_t K, const uint8_t *codes, const float *sm,
              int64_t N, float *y, int threads);
int panel_linear(const float *x, int64_t R, int64_t K, const uint8_t *panels, int fmt, int64_t N,
                 float *y, int threads);
int gguf_linear(const float *x, int64_t R, int64_t K, const uint8_t *w, int64_t row_bytes,
                int type, int64_t N, float *y, int threads);
int paged_attention_window(const float *q, float *out, const void *kc, const void *vc,
                           int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                           const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                           const int32_t *qstart, const int32_t *seqs, int64_t n_seqs,
                           float scale, int threads, int kv_kind, int64_t window, float softcap);
void store_kv_row(void *pool, int64_t index, const float *src, int64_t D, int kind);
void rms_norm(const float *x, const float *add, float *x_out, const float *weight, float *out,
              int64_t T, int64_t D, float eps);

/* x * cos + roll(x, half) * signed_sin over each head of one row (the rotate-half layout). */
static void rotate(float *x, int64_t heads, int64_t hd, const float *cos, const float *ssin) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *xh = x + h * hd;
        #pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = xh[i], b = xh[i + half];
            xh[i] = a * cos[i] + b * ssin[i];
            xh[i + half] = b * cos[i + half] + a * ssin[i + half];
        }
    }
}

/* A packed projection: up to three parts of output rows side by side (a Q4_K_M file's
 * Q4_K q|k beside a Q6_K v), each in pagellm's Q4 form (type 0: codes, scale_min; type
 * PART_PANELS + f: cpu_panels.c's panels of format f) or in its GGUF blocks (a ggml type: raw rows of
 * row_bytes), and an optional float32 bias. Mirrors kernels/cpu_layer.py's Projection. */
#define MAX_PARTS 3
#define PART_PANELS 1000
typedef struct {
    int64_t rows, type;
    const void *w, *sm;
    int64_t row_bytes;
} part_t;
typedef struct {
    int64_t nparts;
    part_t parts[MAX_PARTS];
    const float *bias;
} proj_t;

static int part_linear(const part_t *p, const float *x, int64_t T, int64_t K, float *y, int threads) {
    if (p->type == 0) return q4_linear(x, T, K, p->w, p->sm, p->rows, y, threads);
    if (p->type >= PART_PANELS)
        return panel_linear(x, T, K, p->w, (int)(p->type - PART_PANELS), p->rows, y, threads);
    return gguf_linear(x, T, K, p->w, p->row_bytes, (int)p->type, p->rows, y, threads);
}

/* y [T, N] = x [T, K] W^T (+ bias); tmp holds T * N floats when there are several parts. */
static int project(const proj_t *p, const float *x, int64_t T, int64_t K, float *y, int64_t N,
                   float *tmp, int threads) {
    if (p->nparts == 1) {
        if (part_linear(&p->parts[0], x, T, K, y, threads)) return -1;
    } else {
        for (int64_t i = 0, col = 0; i < p->nparts; col += p->parts[i].rows, i++) {
            const int64_t n = p->parts[i].rows;
            if (part_linear(&p->parts[i], x, T, K, tmp, threads)) return -1;
            for (int64_t t = 0; t < T; t++) memcpy(y + t * N + col, tmp + t * n, sizeof(float) * n);
        }
    }
    if (p->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < N; j++) y[t * N + j] += p->bias[j];
    return 0;
}

/* a[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u */
static void silu_mul(const float *g, const float *u, float *a, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(a + i, silu_mul16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
#endif
#ifdef __AVX2__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(a + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
#endif
    for (; i < n; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* a[i] = gelu(g[i]) * u[i], GELU's tanh form: g / 2 * (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
 * tanh(z) = 1 - 2 / (exp(2z) + 1) (exp8 clamps its argument: +-1 far out) */
static void gelu_mul(const float *g, const float *u, float *a, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.f), two = _mm256_set1_ps(2.f), half = _mm256_set1_ps(0.5f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, x), _mm256_mul_ps(x, x), x));
        const __m256 e = exp8(_mm256_mul_ps(two, z));
        const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, th));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) {
        const float x = g[i];
        a[i] = 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))) * u[i];
    }
}

/* gu [T, 2I] bf16 (gate | up per row) -> a [T, I] bf16 = silu(g) * u, computed in float32 and
 * rounded once: the many-row MLP's gating on CPUs with bf16 units (models/llama.py), where
 * PyTorch's bf16 silu and product over a [2048, 8960] step cost ~25 ms a layer. */
void silu_mul_bf16(const uint16_t *gu, uint16_t *a, int64_t T, int64_t I, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gu + t * 2 * I, *u = g + I;
        uint16_t *out = a + t * I;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= I; i += 16)
            store_bf16x16(out + i, silu_mul16(load_bf16x16(g + i), load_bf16x16(u + i)));
#endif
#ifdef __AVX2__
        for (; i + 8 <= I; i += 8)
            store_bf16x8(out + i, silu_mul8(load_bf16x8(g + i), load_bf16x8(u + i)));
#endif
        for (; i < I; i++) {
            const float gf = bf16_to_f32(g[i]);
            out[i] = f32_to_bf16(gf / (1.f + expf(-gf)) * bf16_to_f32(u[i]));
        }
    }
}

/* What a layer does besides the Llama form (NULL / 0: nothing); mirrors cpu_layer.py's _Ext. */
typedef struct {
    const float *q_norm, *k_norm;  /* per-head RMSNorm weights, q and k before the rotation */
    const float *attn_out_norm;  /* the attention's output normalized before its residual add */
    const float *mlp_out_norm;  /* the MLP's output, likewise */
    int64_t gelu;  /* 1: gelu(g) * u (tanh form); 0: silu(g) * u */
    int64_t window;  /* a sliding window (paged_attention_window); 0: none */
    double softcap;  /* attention scores' soft-capping (Gemma 2); 0: none */
    float *normed_out;  /* non-NULL: stop after the attention (x += attention) and write
                           norm(x) [T, D] here: a mixture of experts' MLP (moe_experts) follows */
} layer_ext_t;

/* projs: qkv, o, gate|up, down; ext: NULL for the Llama form */
int decode_layer_ext(float *x, int64_t T, int64_t D, float eps, const float *norm_in,
                     const float *norm_post, const proj_t *projs, int64_t I, int64_t H,
                     int64_t KVH, int64_t hd, const float *cos, const float *ssin,
                     const int64_t *positions, void *kc, void *vc, int64_t NB, int64_t BS,
                     const int64_t *slots, const int32_t *tables, int64_t MB,
                     const int32_t *seq_lens, const int32_t *qstart, const int32_t *seqs,
                     int64_t n_seqs, float scale, int threads, int kv_kind, const layer_ext_t *ext) {
    const layer_ext_t none = {0};
    if (!ext) ext = &none;
    const int64_t nq = H * hd, nkv = KVH * hd, nqkv = nq + 2 * nkv;
    const int64_t width = nqkv > 2 * I ? nqkv : 2 * I;
    float *h = malloc(sizeof(float) * T * D), *y = malloc(sizeof(float) * T * width);
    float *q = malloc(sizeof(float) * T * nq), *a = malloc(sizeof(float) * T * (nq > I ? nq : I));
    float *d = malloc(sizeof(float) * T * D), *tmp = malloc(sizeof(float) * T * width);
    int rc = -1;
    if (!h || !y || !q || !a || !d || !tmp) goto done;

    rms_norm(x, NULL, NULL, norm_in, h, T, D, eps);
    if (project(&projs[0], h, T, D, y, nqkv, tmp, threads)) goto done;
    for (int64_t t = 0; t < T; t++) {
        float *row = y + t * nqkv;
        const float *c = cos + positions[t] * hd, *s = ssin + positions[t] * hd;
        if (ext->q_norm) {  /* each head's vector, in place */
            rms_norm(row, NULL, NULL, ext->q_norm, row, H, hd, eps);
            rms_norm(row + nq, NULL, NULL, ext->k_norm, row + nq, KVH, hd, eps);
        }
        rotate(row, H + KVH, hd, c, s);  /* q and k heads are adjacent */
        memcpy(q + t * nq, row, sizeof(float) * nq);
        for (int64_t kh = 0; kh < KVH; kh++) {  /* head-major pool [KVH, NB * BS, hd] */
            const int64_t dst = kh * NB * BS + slots[t];
            store_kv_row(kc, dst, row + nq + kh * hd, hd, kv_kind);
            store_kv_row(vc, dst, row + nq + nkv + kh * hd, hd, kv_kind);
        }
    }
    if (paged_attention_window(q, a, kc, vc, H, KVH, hd, NB, BS, tables, MB, seq_lens, qstart,
                               seqs, n_seqs, scale, threads, kv_kind, ext->window,
                               (float)ext->softcap)) goto done;
    if (project(&projs[1], a, T, nq, d, D, tmp, threads)) goto done;
    if (ext->attn_out_norm) rms_norm(d, NULL, NULL, ext->attn_out_norm, d, T, D, eps);
    rms_norm(x, d, x, norm_post, ext->normed_out ? ext->normed_out : h, T, D, eps);  /* x += attention; h = norm(x) */
    if (ext->normed_out) { rc = 0; goto done; }
    if (project(&projs[2], h, T, D, y, 2 * I, tmp, threads)) goto done;
    for (int64_t t = 0; t < T; t++)
        (ext->gelu ? gelu_mul : silu_mul)(y + t * 2 * I, y + t * 2 * I + I, a + t * I, I);
    if (project(&projs[3], a, T, I, d, D, tmp, threads)) goto done;
    if (ext->mlp_out_norm) rms_norm(d, NULL, NULL, ext->mlp_out_norm, d, T, D, eps);
    for (int64_t i = 0; i < T * D; i++) x[i] += d[i];
    rc = 0;
done:
    free(h); free(y); free(q); free(a); free(d); free(tmp);
    return rc;
}

/* A mixture of experts' products for one step (models/moe.py): each pair p sends row
 * rows[p] of x [T, D] to expert experts[p] with weight weights[p]:
 *     out[rows[p]] += weights[p] * down_e(act(gate_e(x_row)) * up_e(x_row))
 * projs: two an expert (gate | up, then down), widths[e] its I. Each expert's rows are
 * gathered and multiplied as one batch, experts in index order (as transformers adds them);
 * an expert no pair names is never read. Returns 0, -1 out of memory, -2 a bad index. */
int moe_experts(const float *x, int64_t T, int64_t D, const proj_t *projs, const int64_t *widths,
                int64_t E, const int64_t *rows, const int64_t *experts, const float *weights,
                int64_t P, float *out, int gelu, int threads) {
    int64_t I = 0;
    for (int64_t e = 0; e < E; e++) I = widths[e] > I ? widths[e] : I;
    for (int64_t p = 0; p < P; p++)
        if (experts[p] < 0 || experts[p] >= E || rows[p] < 0 || rows[p] >= T) return -2;
    if (P == 0) return 0;
    const int64_t width = 2 * I > D ? 2 * I : D;
    int64_t *start = calloc(E + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * P);
    float *xs = NULL, *y = NULL, *a = NULL, *d = NULL, *tmp = NULL;
    int rc = -1;
    if (!start || !order) goto done;
    for (int64_t p = 0; p < P; p++) start[experts[p] + 1]++;  /* counting sort by expert */
    int64_t most = 0;  /* the scratch holds one expert's rows at a time */
    for (int64_t e = 1; e <= E; e++) most = start[e] > most ? start[e] : most;
    xs = malloc(sizeof(float) * most * D); y = malloc(sizeof(float) * most * 2 * I);
    a = malloc(sizeof(float) * most * I); d = malloc(sizeof(float) * most * D);
    tmp = malloc(sizeof(float) * most * width);
    if (!xs || !y || !a || !d || !tmp) goto done;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t p = 0, *next = start; p < P; p++) order[next[experts[p]]++] = p;
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1];  /* (the fill moved each start) */
    start[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e], ie = widths[e];
        if (n == 0) continue;
        const int64_t *pairs = order + start[e];
        for (int64_t i = 0; i < n; i++) memcpy(xs + i * D, x + rows[pairs[i]] * D, sizeof(float) * D);
        if (project(&projs[2 * e], xs, n, D, y, 2 * ie, tmp, threads)) goto done;
        for (int64_t i = 0; i < n; i++)
            (gelu ? gelu_mul : silu_mul)(y + i * 2 * ie, y + i * 2 * ie + ie, a + i * ie, ie);
        if (project(&projs[2 * e + 1], a, n, ie, d, D, tmp, threads)) goto done;
        for (int64_t i = 0; i < n; i++) {
            float *o = out + rows[pairs[i]] * D;
            const float w = weights[pairs[i]], *di = d + i * D;
            for (int64_t j = 0; j < D; j++) o[j] += w * di[j];
        }
    }
    rc = 0;
done:
    free(start); free(order); free(xs); free(y); free(a); free(d); free(tmp);
    return rc;
}

/* A router's choice for each of T rows (models/moe.py SparseMoE.routing): the k largest of
 * its E scores (ties: the lower index), in descending order, into experts [T, k], and their
 * softmax probabilities over all E (renorm: over the k) into weights [T, k]; rows [T, k] gets
 * each pair's row, as moe_experts takes them. Returns -2 for k outside 1..E. */
int moe_route(const float *logits, int64_t T, int64_t E, int64_t k, int renorm,
              int64_t *experts, float *weights, int64_t *rows) {
    if (k < 1 || k > E) return -2;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        int64_t *ex = experts + t * k;
        float *w = weights + t * k;
        for (int64_t j = 0; j < k; j++) {  /* k passes: k is small (2-8) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= ex[i] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ex[j] = best;
            rows[t * k + j] = t;
        }
        const float top = l[ex[0]];
        float total = 0.f, chosen = 0.f;
        for (int64_t e = 0; e < E; e++) total += expf(l[e] - top);
        for (int64_t j = 0; j < k; j++) chosen += (w[j] = expf(l[ex[j]] - top));
        const float norm = renorm ? chosen : total;
        for (int64_t j = 0; j < k; j++) w[j] /= norm;
    }
    return 0;
}

/* decode_layer_ext of the Llama form */
int decode_layer(float *x, int64_t T, int64_t D, float eps, const float *norm_in,
                 const float *norm_post, const proj_t *projs, int64_t I, int64_t H, int64_t KVH, int64_t hd, const float *cos,
                 const float *ssin, const int64_t *positions, void *kc, void *vc, int64_t NB,
                 int64_t BS, const int64_t *slots, const int32_t *tables, int64_t MB,
                 const int32_t *seq_lens, const int32_t *qstart, const int32_t *seqs,
                 int64_t n_seqs, float scale, int threads, int kv_kind) {
    return decode_layer_ext(x, T, D, eps, norm_in, norm_post, projs, I, H, KVH, hd, cos, ssin,
                            positions, kc, vc, NB, BS, slots, tables, MB, seq_lens, qstart, seqs,
                            n_seqs, scale, threads, kv_kind, NULL);
}
