/* Greedy sampling's argmax over rows of float32 logits (pagellm/sampling/sampler.py).
 *
 * torch.argmax over [64, 49152] float32 took 1.9 ms on two Zen 5 cores (~1.7 ns a value on one
 * thread), 4% of a 64-row decode step of the default model; two vectorized passes over each
 * row (the maximum, then its first index) take ~0.1 ms. Same result as torch.argmax: the
 * first index of the maximum, or of the first NaN where a row has one (NaN counts as the
 * largest value).
 */
#include <stdint.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static int64_t argmax_row(const float *x, int64_t V) {
    int64_t i = 0;
    float mx = -__builtin_inff();
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    if (nan) i = 0;  /* the first NaN, found below */
    else mx = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-__builtin_inff());
    int nan = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    if (nan) {
        i = 0;
    } else {
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    for (int64_t j = i; j < V; j++) {
        if (x[j] != x[j]) {  /* NaN: the first one wins */
            for (int64_t k = 0; k <= j; k++)
                if (x[k] != x[k]) return k;
        }
        if (x[j] > mx) mx = x[j];
    }
    i = 0;
#ifdef __AVX512F__
    const __m512 target = _mm512_set1_ps(mx);
    for (; i + 16 <= V; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    const __m256 target = _mm256_set1_ps(mx);
    for (; i + 8 <= V; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < V; i++)
        if (x[i] == mx) return i;
    return 0;  /* every value -inf is found above; an empty row has index 0 */
}

/* x [R, V] float32 (rows contiguous) -> out [R] int64 */
void argmax_rows(const float *x, int64_t R, int64_t V, int64_t *out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R > 1)
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * V, V);
}
