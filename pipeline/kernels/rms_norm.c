/* RMSNorm with the residual addition fused in, on the CPU in float32.
 *
 * In PyTorch the residual add and RMSNorm are six passes and six dispatches, twice per
 * layer; this is two passes over each row and one call.
 * All arrays are contiguous, rows x dim.
 */
#include <math.h>
#include <stdint.h>

/* residual += x (when residual is not NULL); out = residual * rsqrt(mean(residual^2) + eps) * weight.
 * Without a residual: out = rmsnorm(x). */
void add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                  int64_t dim, float eps) {
#pragma omp parallel for if (rows > 32)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        const float *src = xr;   /* the row that is normed */
        float *o = out + r * dim;
        float sum = 0.0f;
        if (residual) {
            float *res = residual + r * dim;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) {
                float v = res[i] + xr[i];
                res[i] = v;
                sum += v * v;
            }
            src = res;
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) sum += src[i] * src[i];
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = src[i] * inv * weight[i];
    }
}
