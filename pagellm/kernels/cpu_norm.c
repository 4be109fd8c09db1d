/* RMSNorm over float32 rows, optionally fused with the residual add before it:
 *   x_out = x + add (when add is given), out = x_out / sqrt(mean(x_out^2) + eps) * weight.
 * One pass per row instead of PyTorch's ~6 ops (pow, mean, add, rsqrt, mul, mul) plus the
 * residual add, which cost more than the arithmetic for the few rows of a decode step. */
#include <math.h>
#include <stdint.h>

void rms_norm(const float *x, const float *add, float *x_out, const float *weight, float *out,
              int64_t T, int64_t D, float eps) {
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * D;
        float *outr = out + t * D;
        float ss = 0.f;
        if (add) {
            const float *ar = add + t * D;
            float *xo = x_out + t * D;
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < D; i++) { float v = xr[i] + ar[i]; xo[i] = v; ss += v * v; }
            xr = xo;
        } else {
            #pragma omp simd reduction(+:ss)
            for (int64_t i = 0; i < D; i++) ss += xr[i] * xr[i];
        }
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        #pragma omp simd
        for (int64_t i = 0; i < D; i++) outr[i] = xr[i] * r * weight[i];
    }
}
