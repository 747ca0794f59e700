/* RMSNorm with the residual addition fused in, on the CPU in float32 or bfloat16.
 *
 * In PyTorch the residual add and RMSNorm are six passes and six dispatches, twice per
 * layer; this is two passes over each row and one call.
 * All arrays are contiguous, rows x dim.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

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

/* The same in bfloat16 (x, residual, weight, out), computed in float32: the residual is
 * rounded to bf16 when stored, and that stored value is what is normed (as the PyTorch
 * path norms the bf16 residual); the output is rounded once. */
void add_rms_norm_bf16(const bf16 *x, bf16 *residual, const bf16 *weight, bf16 *out, int64_t rows,
                       int64_t dim, float eps) {
#pragma omp parallel for if (rows > 32)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * dim;
        const bf16 *src = xr;
        bf16 *o = out + r * dim;
        float sum = 0.0f;
        if (residual) {
            bf16 *res = residual + r * dim;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) {
                bf16 v = float_to_bf16(bf16_to_float(res[i]) + bf16_to_float(xr[i]));
                res[i] = v;
                sum += bf16_to_float(v) * bf16_to_float(v);
            }
            src = res;
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) sum += bf16_to_float(src[i]) * bf16_to_float(src[i]);
        }
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = float_to_bf16(bf16_to_float(src[i]) * inv * bf16_to_float(weight[i]));
    }
}
