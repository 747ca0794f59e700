/* Rotary embedding and the KV-cache write, fused, on the CPU in float32 or bfloat16.
 *
 * After the fused q|k|v projection, PyTorch needs about a dozen small operations per
 * layer to rotate queries and keys and scatter the new keys and values into the paged
 * cache; in a decode step each costs more in dispatch than in arithmetic. This is one
 * pass over the new tokens.
 *
 *   qkv         [tokens, (heads + 2 * kv_heads) * head_dim], rotated in place: the loader
 *               interleaves q/k rows so that entries (2i, 2i+1) of a head form rotary pair i
 *   cos, sin    [tokens, head_dim / 2], each token's angles
 *   cache_rows  [tokens * kv_heads], where each token's heads go in a layer's cache viewed
 *               as [blocks * kv_heads * block_size, head_dim] (pipeline/layers/attention/cpu_paged.py)
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

void rotary_write_kv(float *qkv, const float *cos, const float *sin, const int64_t *cache_rows,
                     float *k_cache, float *v_cache, int64_t tokens, int heads, int kv_heads,
                     int head_dim) {
    const int half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel for if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads + kv_heads; h++) {
            float *x = row + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = x[2 * i], b = x[2 * i + 1];
                x[2 * i] = a * c[i] - b * s[i];
                x[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
        const float *k = row + (int64_t)heads * head_dim, *v = k + (int64_t)kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++) {
            int64_t dst = cache_rows[t * kv_heads + h] * head_dim;
            memcpy(k_cache + dst, k + (int64_t)h * head_dim, sizeof(float) * head_dim);
            memcpy(v_cache + dst, v + (int64_t)h * head_dim, sizeof(float) * head_dim);
        }
    }
}

/* The same in bfloat16 (qkv and the caches; cos and sin stay float32), each rotated
 * value computed in float32 and rounded once, as the PyTorch path does. */
void rotary_write_kv_bf16(bf16 *qkv, const float *cos, const float *sin, const int64_t *cache_rows,
                          bf16 *k_cache, bf16 *v_cache, int64_t tokens, int heads, int kv_heads,
                          int head_dim) {
    const int half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel for if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        bf16 *row = qkv + t * width;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads + kv_heads; h++) {
            bf16 *x = row + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = bf16_to_float(x[2 * i]), b = bf16_to_float(x[2 * i + 1]);
                x[2 * i] = float_to_bf16(a * c[i] - b * s[i]);
                x[2 * i + 1] = float_to_bf16(a * s[i] + b * c[i]);
            }
        }
        const bf16 *k = row + (int64_t)heads * head_dim, *v = k + (int64_t)kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++) {
            int64_t dst = cache_rows[t * kv_heads + h] * head_dim;
            memcpy(k_cache + dst, k + (int64_t)h * head_dim, sizeof(bf16) * head_dim);
            memcpy(v_cache + dst, v + (int64_t)h * head_dim, sizeof(bf16) * head_dim);
        }
    }
}

/* ---- INT8 KV cache (pipeline/layers/quantization/int8_kv_cache.py) ------------------------------------------------
 * The same rotation, then each token's key and value heads quantized on the way into an
 * int8 cache: scale = max|x| / 127 per (token, head), x8 = round-half-even(x * (127 / max|x|)),
 * the same float32 operations as kv_quant.quantize, so both paths store identical bytes.
 * scales: [blocks, kv_heads, block_size] float32 per layer, indexed by the same cache row. */
#include <math.h>

static inline void quantize_head_f32(const float *x, int head_dim, int8_t *dst, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < head_dim; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < head_dim; i++) dst[i] = (int8_t)nearbyintf(x[i] * inv);
    *scale = amax * (1.0f / 127.0f);
}

static inline void quantize_head_bf16(const bf16 *x, int head_dim, int8_t *dst, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < head_dim; i++) amax = fmaxf(amax, fabsf(bf16_to_float(x[i])));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < head_dim; i++) dst[i] = (int8_t)nearbyintf(bf16_to_float(x[i]) * inv);
    *scale = amax * (1.0f / 127.0f);
}

void rotary_write_kv_int8(float *qkv, const float *cos, const float *sin, const int64_t *cache_rows,
                          int8_t *k_cache, int8_t *v_cache, int64_t tokens, int heads, int kv_heads,
                          int head_dim, float *k_scales, float *v_scales) {
    const int half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel for if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads + kv_heads; h++) {
            float *x = row + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = x[2 * i], b = x[2 * i + 1];
                x[2 * i] = a * c[i] - b * s[i];
                x[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
        const float *k = row + (int64_t)heads * head_dim, *v = k + (int64_t)kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++) {
            int64_t r = cache_rows[t * kv_heads + h];
            quantize_head_f32(k + (int64_t)h * head_dim, head_dim, k_cache + r * head_dim, k_scales + r);
            quantize_head_f32(v + (int64_t)h * head_dim, head_dim, v_cache + r * head_dim, v_scales + r);
        }
    }
}

void rotary_write_kv_int8_bf16(bf16 *qkv, const float *cos, const float *sin, const int64_t *cache_rows,
                               int8_t *k_cache, int8_t *v_cache, int64_t tokens, int heads, int kv_heads,
                               int head_dim, float *k_scales, float *v_scales) {
    const int half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel for if (tokens > 64)
    for (int64_t t = 0; t < tokens; t++) {
        bf16 *row = qkv + t * width;
        const float *c = cos + t * half, *s = sin + t * half;
        for (int h = 0; h < heads + kv_heads; h++) {
            bf16 *x = row + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = bf16_to_float(x[2 * i]), b = bf16_to_float(x[2 * i + 1]);
                x[2 * i] = float_to_bf16(a * c[i] - b * s[i]);
                x[2 * i + 1] = float_to_bf16(a * s[i] + b * c[i]);
            }
        }
        const bf16 *k = row + (int64_t)heads * head_dim, *v = k + (int64_t)kv_heads * head_dim;
        for (int h = 0; h < kv_heads; h++) {
            int64_t r = cache_rows[t * kv_heads + h];
            quantize_head_bf16(k + (int64_t)h * head_dim, head_dim, k_cache + r * head_dim, k_scales + r);
            quantize_head_bf16(v + (int64_t)h * head_dim, head_dim, v_cache + r * head_dim, v_scales + r);
        }
    }
}
