/* Per-token int8 quantization of a linear layer's input, on the CPU in float32 or bfloat16.
 *
 * w8a8's oneDNN path (int8_linear.py) divides each row by its largest |x| and quantizes
 * the result with fixed parameters; in PyTorch that is six passes over the activations
 * (abs, amax, clamp, divide, quantize, copy out the bytes), which measured slower than the
 * int8 product itself. This is two passes over each row and one call: with f = levels / top
 * (one division a row), q = rint(x * f) + zero_point, clamped to 0..255 (rint rounds half
 * to even, as torch.round does). int8_linear.py's PyTorch fallback computes the same.
 * A division per element instead measured 3x slower.
 *
 *   x    [rows, cols]  ->  q [rows, cols] uint8,  top [rows] float32 (the row's max |x|,
 *                          at least MIN_TOP, so that levels / top stays finite and a
 *                          zero row gives zero_point)
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define MIN_TOP 1e-30f   /* int8_linear.MIN_TOP */

static inline uint8_t quantize_one(float x, float factor, int32_t zero_point) {
    /* |x * factor| <= levels (<= 127), so the int32 conversion cannot overflow */
    int32_t v = (int32_t)rintf(x * factor) + zero_point;
    v = v < 0 ? 0 : (v > 255 ? 255 : v);
    return (uint8_t)v;
}

void quantize_rows_u8(const float *x, uint8_t *q, float *top, int64_t rows, int64_t cols, float levels,
                      int32_t zero_point) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict xr = x + r * cols;
        uint8_t *restrict qr = q + r * cols;
        float m = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < cols; i++) {
            const float a = fabsf(xr[i]);
            m = a > m ? a : m;
        }
        m = m < MIN_TOP ? MIN_TOP : m;
        top[r] = m;
        const float factor = levels / m;
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) qr[i] = quantize_one(xr[i], factor, zero_point);
    }
}

/* The same from bfloat16 input (widened exactly to float32 first). */
void quantize_rows_u8_bf16(const bf16 *x, uint8_t *q, float *top, int64_t rows, int64_t cols, float levels,
                           int32_t zero_point) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *restrict xr = x + r * cols;
        uint8_t *restrict qr = q + r * cols;
        float m = 0.0f;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < cols; i++) {
            const float a = fabsf(bf16_to_float(xr[i]));
            m = a > m ? a : m;
        }
        m = m < MIN_TOP ? MIN_TOP : m;
        top[r] = m;
        const float factor = levels / m;
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) qr[i] = quantize_one(bf16_to_float(xr[i]), factor, zero_point);
    }
}

/* The way back, one pass over the product: out[r, c] = acc[r, c] * row_scale[r] * col_scale[c]
 * + bias[c], in that order whatever the shape, so a row's result never depends on its batch
 * (bias may be NULL; out may be acc itself). acc is the exact int32 product, as float32.
 * In PyTorch this is three passes over what is the largest tensor of a layer (gate_up's
 * output): each measured 0.25 ms at 1024 x 3072. */
void scale_rows(const float *acc, const float *row_scale, const float *col_scale, const float *bias, float *out,
                int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = acc + r * cols;
        float *o = out + r * cols;
        const float t = row_scale[r];
        if (bias) {
#pragma omp simd
            for (int64_t i = 0; i < cols; i++) o[i] = a[i] * t * col_scale[i] + bias[i];
        } else {
#pragma omp simd
            for (int64_t i = 0; i < cols; i++) o[i] = a[i] * t * col_scale[i];
        }
    }
}

/* The same into bfloat16 (computed in float32, rounded once). */
void scale_rows_bf16(const float *acc, const float *row_scale, const float *col_scale, const float *bias, bf16 *out,
                     int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float *a = acc + r * cols;
        bf16 *o = out + r * cols;
        const float t = row_scale[r];
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) o[i] = float_to_bf16(a[i] * t * col_scale[i] + (bias ? bias[i] : 0.0f));
    }
}
