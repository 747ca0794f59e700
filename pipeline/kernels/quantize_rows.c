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

/* x's element i as float32: x is float32, or bfloat16 when is_bf16. */
static inline float load(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const bf16 *)x)[i]) : ((const float *)x)[i];
}

/* One row. is_bf16 is a literal in each caller's loop, so each gets its own specialised,
 * vectorised copy (a flag passed through the OpenMP loop instead measured 5x slower). */
static inline float quantize_row(const void *x, uint8_t *restrict q, int64_t cols, float levels, int32_t zero_point,
                                 int is_bf16) {
    float m = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < cols; i++) {
        const float a = fabsf(load(x, i, is_bf16));
        m = a > m ? a : m;
    }
    m = m < MIN_TOP ? MIN_TOP : m;
    const float factor = levels / m;
#pragma omp simd
    for (int64_t i = 0; i < cols; i++) q[i] = quantize_one(load(x, i, is_bf16), factor, zero_point);
    return m;
}

void quantize_rows_u8(const float *x, uint8_t *q, float *top, int64_t rows, int64_t cols, float levels,
                      int32_t zero_point) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) top[r] = quantize_row(x + r * cols, q + r * cols, cols, levels, zero_point, 0);
}

/* The same from bfloat16 input (widened exactly to float32 first). */
void quantize_rows_u8_bf16(const bf16 *x, uint8_t *q, float *top, int64_t rows, int64_t cols, float levels,
                           int32_t zero_point) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) top[r] = quantize_row(x + r * cols, q + r * cols, cols, levels, zero_point, 1);
}

/* The way back, one pass over the product: out[r, c] = acc[r, c] * row_scale[r] * col_scale[c]
 * + bias[c], in that order whatever the shape, so a row's result never depends on its batch
 * (bias may be NULL; out may be acc itself). acc is the exact int32 product, as float32.
 * In PyTorch this is three passes over what is the largest tensor of a layer (gate_up's
 * output): each measured 0.25 ms at 1024 x 3072. */
static inline void store(void *out, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((bf16 *)out)[i] = float_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

/* One row (is_bf16 a literal in each caller, as for quantize_row). */
static inline void scale_row(const float *a, float t, const float *col_scale, const float *bias, void *o, int64_t cols,
                             int is_bf16) {
    if (bias) {
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) store(o, i, a[i] * t * col_scale[i] + bias[i], is_bf16);
    } else {
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) store(o, i, a[i] * t * col_scale[i], is_bf16);
    }
}

void scale_rows(const float *acc, const float *row_scale, const float *col_scale, const float *bias, float *out,
                int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) scale_row(acc + r * cols, row_scale[r], col_scale, bias, out + r * cols, cols, 0);
}

/* The same into bfloat16 (computed in float32, rounded once). */
void scale_rows_bf16(const float *acc, const float *row_scale, const float *col_scale, const float *bias, bf16 *out,
                     int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows > 8)
    for (int64_t r = 0; r < rows; r++) scale_row(acc + r * cols, row_scale[r], col_scale, bias, out + r * cols, cols, 1);
}
