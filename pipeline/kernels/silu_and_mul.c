/* SiLU-and-multiply of the fused gate|up projection, on the CPU in float32 or bfloat16.
 *
 * PyTorch takes two passes (silu, then the product) over a strided half of the
 * projection; this is one. expf from libm does not vectorise without -ffast-math, so
 * exp is computed here the usual way (Cody-Waite range reduction, a degree-6
 * polynomial, the exponent set by integer arithmetic): within 2 ulp, in SIMD.
 *
 *   gate_up  [rows, 2 * inter], the gate first;  out  [rows, inter] = silu(gate) * up
 */
#include <stdint.h>

#include "bf16.h"

static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* n = round(x / ln 2): adding 1.5 * 2^23 rounds to an integer (and vectorises, unlike roundf) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* x - n ln 2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } bits = {p};
    bits.i += (int32_t)n << 23;                                  /* times 2^n */
    return bits.f;
}

void silu_and_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict g = gate_up + r * 2 * inter;
        const float *restrict u = g + inter;
        float *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* The same in bfloat16, computed in float32 and rounded once. */
void silu_and_mul_bf16(const bf16 *gate_up, bf16 *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *restrict g = gate_up + r * 2 * inter;
        const bf16 *restrict u = g + inter;
        bf16 *restrict o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = bf16_to_float(g[i]);
            o[i] = float_to_bf16(x / (1.0f + exp_approx(-x)) * bf16_to_float(u[i]));
        }
    }
}
