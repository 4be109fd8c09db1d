/* Paged attention for short queries (decode, speculative verification) over a float32 KV pool
 * stored head-major, [kv_heads, num_blocks, block_size, head_dim] (pagellm/attention/torch_paged.py).
 *
 * Reads each sequence's K/V in place through its block table: no gathered copy of the context
 * and no padding to the longest sequence of the batch. One task per (sequence, KV head) takes
 * the group of query heads that share that KV head, for every query row of the sequence, so
 * each K and V row is loaded once per task. Query row j of sequence s sits at position
 * seq_len - query_len + j and sees keys 0 ..= that position (the causal rule of base.py).
 * Scores are exact float32 dot products; softmax subtracts the row maximum, as torch's does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* q, out [T, H, D]; kc, vc [KVH, NB, BS, D]; tables [S, MB]; seq_lens [S]; qstart [S + 1];
 * seqs [n_seqs]: the sequences to attend for (the others are left alone in out).
 * Returns 0, or -1 when out of memory. */
int paged_attention(const float *q, float *out, const float *kc, const float *vc,
                    int64_t H, int64_t KVH, int64_t D, int64_t NB, int64_t BS,
                    const int32_t *tables, int64_t MB, const int32_t *seq_lens,
                    const int32_t *qstart, const int32_t *seqs, int64_t n_seqs,
                    float scale, int threads) {
    const int64_t group = H / KVH;
    int failed = 0;
    #pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1) collapse(2)
    for (int64_t i = 0; i < n_seqs; i++) {
        for (int64_t kvh = 0; kvh < KVH; kvh++) {
            const int64_t s = seqs[i], L = seq_lens[s], q0 = qstart[s], ql = qstart[s + 1] - q0;
            const int64_t rows = ql * group;
            /* scores [rows, L], then probabilities in place */
            float *p = malloc(sizeof(float) * rows * (L > 0 ? L : 1));
            if (!p) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const int32_t *table = tables + s * MB;
            for (int64_t t = 0; t < L; t++) {
                const float *k = kc + ((kvh * NB + table[t / BS]) * BS + t % BS) * D;
                for (int64_t j = 0; j < ql; j++) {
                    const int64_t visible = L - ql + j;  /* last key position row j sees */
                    for (int64_t g = 0; g < group; g++) {
                        const float *qr = q + ((q0 + j) * H + kvh * group + g) * D;
                        p[(j * group + g) * L + t] = t <= visible ? scale * dot(qr, k, D) : -INFINITY;
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
                const float *v = vc + ((kvh * NB + table[t / BS]) * BS + t % BS) * D;
                for (int64_t j = 0; j < ql; j++) {
                    if (t > L - ql + j) continue;
                    for (int64_t g = 0; g < group; g++)
                        axpy(out + ((q0 + j) * H + kvh * group + g) * D, p[(j * group + g) * L + t], v, D);
                }
            }
            free(p);
        }
    }
    return failed ? -1 : 0;
}

/* k, v [T, KVH, D] -> slots of the head-major pools kc, vc [KVH, NB * BS, D]. */
void write_kv(const float *k, const float *v, float *kc, float *vc, const int64_t *slots,
              int64_t T, int64_t KVH, int64_t D, int64_t slots_per_head) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < KVH; h++) {
            const int64_t dst = (h * slots_per_head + slots[t]) * D, src = (t * KVH + h) * D;
            memcpy(kc + dst, k + src, sizeof(float) * D);
            memcpy(vc + dst, v + src, sizeof(float) * D);
        }
}
