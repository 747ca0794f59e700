/* Decode attention over the paged KV cache, on the CPU, in float32 or bfloat16.
 *
 * One query token per sequence attends to its own cache blocks, read in place: no
 * gathered copy of the keys and values is ever made. On a CPU, decode attention is
 * bound by memory traffic (every step reads each sequence's whole context); this
 * kernel reads it exactly once. Work items are (sequence, kv head) pairs, each
 * handling its group of query heads so that every key and value row is loaded once
 * for the whole group (grouped-query attention).
 *
 * The bfloat16 variant reads bf16 queries, keys and values and computes in float32
 * (scores, softmax and the weighted sum; the queries are scaled before q.k), writing a
 * bf16 output: bf16 halves the bytes read, which is what decode attention costs.
 *
 * The int8 variants (`_kv8`) read an INT8 KV cache (pipeline/layers/quantization/int8_kv_cache.py): int8 keys and
 * values with one float32 scale per token and kv head, widened in registers. The scales
 * are applied outside the dot products: score = scale_k[t] * (q . k8[t]), and each value
 * row's weight is p[t] * scale_v[t]; a quarter of float32's bytes per key and value.
 *
 * Layouts (all contiguous):
 *   q              [num_seqs, num_heads, head_dim], sequences q_seq_stride elements apart
 *   out            [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, num_kv_heads, block_size, head_dim]  (one layer)
 *   block_tables   [num_seqs, max_blocks]   int32, the blocks of each sequence in order
 *   context_lens   [num_seqs]               int32, tokens each sequence attends to
 *   k_scales, v_scales [num_blocks, num_kv_heads, block_size]  float32 (int8 caches only)
 *
 * Built by pipeline/kernels/cpu_kernels.py with the system C compiler and OpenMP; it
 * shares PyTorch's OpenMP runtime, so it uses the same threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline void prefetch(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i);
}

#define LANES 8

/* Cache element types. */
#define KV_F32 0
#define KV_BF16 1
#define KV_INT8 2

typedef int8_t i8x8 __attribute__((vector_size(8), aligned(1)));

/* Vector j of row t of a block slab, widened to float32 when the cache is bf16 or int8
 * (int8: still to be multiplied by the row's scale). */
static inline __attribute__((always_inline)) vec8 load_row(const void *slab, size_t t, int j,
                                                            int head_dim, const int kind) {
    if (kind == KV_INT8)
        return __builtin_convertvector(*(const i8x8 *)((const int8_t *)slab + t * head_dim + (size_t)j * LANES), vec8);
    if (kind == KV_BF16) return load_bf16x8((const bf16 *)slab + t * head_dim + (size_t)j * LANES);
    return ((const vec8 *)((const float *)slab + t * head_dim))[j];
}

static inline float hsum(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One (sequence, kv head) pair: its `group` query heads against its `len` cached tokens.
 * head_dim is a multiple of 8. Always inlined into callers that fix head_dim and the
 * element type, so the loops over it unroll into registers. The loops are ordered for
 * independent dependency chains: one chain per token for the scores, one per vector of
 * the output for the values. In float32, q is read in place and the scale applied to the
 * scores (as before bf16 existed: bit-for-bit the same results); in bf16, q is widened
 * and scaled once into qf. */
static inline __attribute__((always_inline)) void attend_one(
        const void *restrict q_in, const void *restrict k_cache, const void *restrict v_cache,
        const int32_t *restrict blocks, int len, void *restrict out_v, int group, int num_kv_heads,
        int kv_head, const int head_dim, int block_size, float scale,
        float *restrict scores /* [group, len] */, float *restrict qf /* [group, head_dim] */,
        const float *restrict k_scales, const float *restrict v_scales, const int is_bf16, const int kv8) {
    const int nvec = head_dim / LANES;
    const int kind = kv8 ? KV_INT8 : is_bf16 ? KV_BF16 : KV_F32;
    const size_t elem = kv8 ? 1 : is_bf16 ? sizeof(bf16) : sizeof(float);
    /* int8: one scale per token of a block slab; block b, head h starts at (b * kvh + h) * bs */
    const size_t scale_block_stride = (size_t)num_kv_heads * block_size;
    const size_t scale_head_offset = (size_t)kv_head * block_size;
    const size_t block_stride = (size_t)num_kv_heads * block_size * head_dim;
    const size_t head_offset = (size_t)kv_head * block_size * head_dim;
    const size_t slab = (size_t)block_size * head_dim;   /* elements of one head in a block */
    const char *kc = k_cache, *vc = v_cache;
    const float *q = q_in;
    float score_scale = scale;
    if (is_bf16) {
        for (int i = 0; i < group * head_dim; i++) qf[i] = bf16_to_float(((const bf16 *)q_in)[i]) * scale;
        q = qf;
        score_scale = 1.0f;
    }

    /* Scores: q . k for every token of the context, four tokens at a time. Blocks lie
     * anywhere in the pool and hardware prefetchers stop at their edges, so fetch the next
     * block's keys (and this block's values, read in the second pass) meanwhile. */
    for (int pos = 0; pos < len; pos += block_size) {
        const char *k = kc + ((size_t)blocks[pos / block_size] * block_stride + head_offset) * elem;
        const char *k_next = pos + block_size < len
            ? kc + ((size_t)blocks[pos / block_size + 1] * block_stride + head_offset) * elem : NULL;
        const char *v_here = vc + ((size_t)blocks[pos / block_size] * block_stride + head_offset) * elem;
        const int n = len - pos < block_size ? len - pos : block_size;
        const float *ks = kv8 ? k_scales + blocks[pos / block_size] * scale_block_stride + scale_head_offset : NULL;
        if (n < 4) {
            if (k_next) prefetch(k_next, slab * elem);
            prefetch(v_here, slab * elem);
        }
        for (int g = 0; g < group; g++) {
            const vec8 *qv = (const vec8 *)(q + (size_t)g * head_dim);
            float *srow = scores + (size_t)g * len + pos;
            int t = 0;
            for (; t + 4 <= n; t += 4) {
                if (g == 0) {   /* spread the prefetches: a burst would stall on fill buffers */
                    if (k_next) prefetch(k_next + (size_t)t * head_dim * elem, 4 * (size_t)head_dim * elem);
                    prefetch(v_here + (size_t)t * head_dim * elem, 4 * (size_t)head_dim * elem);
                }
                vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int j = 0; j < nvec; j++) {
                    vec8 x = qv[j];
                    a0 += x * load_row(k, t, j, head_dim, kind);
                    a1 += x * load_row(k, t + 1, j, head_dim, kind);
                    a2 += x * load_row(k, t + 2, j, head_dim, kind);
                    a3 += x * load_row(k, t + 3, j, head_dim, kind);
                }
                if (kv8) {
                    srow[t] = hsum(a0) * score_scale * ks[t]; srow[t + 1] = hsum(a1) * score_scale * ks[t + 1];
                    srow[t + 2] = hsum(a2) * score_scale * ks[t + 2]; srow[t + 3] = hsum(a3) * score_scale * ks[t + 3];
                } else {
                    srow[t] = hsum(a0) * score_scale; srow[t + 1] = hsum(a1) * score_scale;
                    srow[t + 2] = hsum(a2) * score_scale; srow[t + 3] = hsum(a3) * score_scale;
                }
            }
            for (; t < n; t++) {
                vec8 a0 = {0};
                for (int j = 0; j < nvec; j++) a0 += qv[j] * load_row(k, t, j, head_dim, kind);
                srow[t] = hsum(a0) * score_scale * (kv8 ? ks[t] : 1.0f);
            }
        }
    }

    /* Softmax numerators; the normalisation is applied once, to the output. */
    float denom[group];
    for (int g = 0; g < group; g++) {
        float *s = scores + (size_t)g * len, m = -INFINITY, sum = 0.0f;
        for (int i = 0; i < len; i++) m = s[i] > m ? s[i] : m;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < len; i++) {
            s[i] = expf(s[i] - m);
            sum += s[i];
        }
        denom[g] = sum;
    }

    /* Weighted sum of the values, one query head at a time with its output in registers. */
    for (int g = 0; g < group; g++) {
        vec8 acc[nvec];
        for (int j = 0; j < nvec; j++) acc[j] = (vec8){0};
        const float *p = scores + (size_t)g * len;
        for (int pos = 0; pos < len; pos += block_size) {
            const char *v = vc + ((size_t)blocks[pos / block_size] * block_stride + head_offset) * elem;
            const int n = len - pos < block_size ? len - pos : block_size;
            const float *vs = kv8 ? v_scales + blocks[pos / block_size] * scale_block_stride + scale_head_offset : NULL;
            for (int t = 0; t < n; t++) {
                const float w = kv8 ? p[pos + t] * vs[t] : p[pos + t];
                for (int j = 0; j < nvec; j++) acc[j] += w * load_row(v, t, j, head_dim, kind);
            }
        }
        const float inv = 1.0f / denom[g];
        if (is_bf16) {
            bf16 *o = (bf16 *)out_v + (size_t)g * head_dim;
            for (int j = 0; j < nvec; j++)
                for (int i = 0; i < LANES; i++) o[j * LANES + i] = float_to_bf16(acc[j][i] * inv);
        } else {
            vec8 *o = (vec8 *)((float *)out_v + (size_t)g * head_dim);
            for (int j = 0; j < nvec; j++) o[j] = acc[j] * inv;
        }
    }
}

typedef void (*attend_fn)(const void *, const void *, const void *, const int32_t *, int, void *, int,
                          int, int, int, int, float, float *, float *, const float *, const float *);

#define ATTEND_WITH(NAME, D, BF16, KV8)                                                           \
    static void NAME(const void *q, const void *k, const void *v, const int32_t *b, int len,      \
                     void *out, int group, int kvh, int h, int hd, int bs, float scale,           \
                     float *scores, float *qf, const float *ks, const float *vs) {                \
        (void)hd;                                                                                  \
        attend_one(q, k, v, b, len, out, group, kvh, h, D, bs, scale, scores, qf, ks, vs, BF16, KV8); \
    }
ATTEND_WITH(attend_f32_64, 64, 0, 0)
ATTEND_WITH(attend_f32_128, 128, 0, 0)
ATTEND_WITH(attend_f32_any, hd, 0, 0)
ATTEND_WITH(attend_bf16_64, 64, 1, 0)
ATTEND_WITH(attend_bf16_128, 128, 1, 0)
ATTEND_WITH(attend_bf16_any, hd, 1, 0)
ATTEND_WITH(attend_f32_kv8_64, 64, 0, 1)
ATTEND_WITH(attend_f32_kv8_128, 128, 0, 1)
ATTEND_WITH(attend_f32_kv8_any, hd, 0, 1)
ATTEND_WITH(attend_bf16_kv8_64, 64, 1, 1)
ATTEND_WITH(attend_bf16_kv8_128, 128, 1, 1)
ATTEND_WITH(attend_bf16_kv8_any, hd, 1, 1)

static int run(attend_fn attend, size_t elem, const void *q, int64_t q_seq_stride, const void *k_cache,
               const void *v_cache, const float *k_scales, const float *v_scales,
               const int32_t *block_tables, const int32_t *context_lens, void *out,
               int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
               float scale) {
    if (head_dim % LANES != 0) return -2;
    const int group = num_heads / num_kv_heads;
    int failed = 0;
#pragma omp parallel for schedule(dynamic)
    for (int item = 0; item < num_seqs * num_kv_heads; item++) {
        int s = item / num_kv_heads, h = item % num_kv_heads;
        int len = context_lens[s];
        /* scores [group, len], then the widened queries [group, head_dim] */
        float *scores = malloc(sizeof(float) * (size_t)group * ((len > 0 ? len : 1) + head_dim));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        size_t head = (size_t)h * group * head_dim;   /* first query head of this kv head */
        attend((const char *)q + ((size_t)s * q_seq_stride + head) * elem, k_cache, v_cache,
               block_tables + (size_t)s * max_blocks, len,
               (char *)out + ((size_t)s * num_heads * head_dim + head) * elem, group, num_kv_heads, h,
               head_dim, block_size, scale, scores, scores + (size_t)group * (len > 0 ? len : 1),
               k_scales, v_scales);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Returns 0, -1 when scratch memory could not be allocated, -2 when head_dim is not a
 * multiple of 8 (callers check that first). */
int paged_decode_attention(const float *q, int64_t q_seq_stride, const float *k_cache,
                           const float *v_cache, const int32_t *block_tables, const int32_t *context_lens, float *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale) {
    attend_fn attend = head_dim == 64 ? attend_f32_64 : head_dim == 128 ? attend_f32_128 : attend_f32_any;
    return run(attend, sizeof(float), q, q_seq_stride, k_cache, v_cache, NULL, NULL, block_tables, context_lens,
               out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);
}

int paged_decode_attention_bf16(const bf16 *q, int64_t q_seq_stride, const bf16 *k_cache,
                                const bf16 *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                                bf16 *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                int block_size, int max_blocks, float scale) {
    attend_fn attend = head_dim == 64 ? attend_bf16_64 : head_dim == 128 ? attend_bf16_128 : attend_bf16_any;
    return run(attend, sizeof(bf16), q, q_seq_stride, k_cache, v_cache, NULL, NULL, block_tables, context_lens,
               out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);
}

/* The same with an int8 cache and its scales; q and out float32 (`_kv8`) or bf16 (`_kv8_bf16`). */
int paged_decode_attention_kv8(const float *q, int64_t q_seq_stride, const int8_t *k_cache,
                               const int8_t *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                               float *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int block_size, int max_blocks, float scale, const float *k_scales,
                               const float *v_scales) {
    attend_fn attend = head_dim == 64 ? attend_f32_kv8_64 : head_dim == 128 ? attend_f32_kv8_128 : attend_f32_kv8_any;
    return run(attend, sizeof(float), q, q_seq_stride, k_cache, v_cache, k_scales, v_scales, block_tables,
               context_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);
}

int paged_decode_attention_kv8_bf16(const bf16 *q, int64_t q_seq_stride, const int8_t *k_cache,
                                    const int8_t *v_cache, const int32_t *block_tables, const int32_t *context_lens,
                                    bf16 *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, int max_blocks, float scale, const float *k_scales,
                                    const float *v_scales) {
    attend_fn attend = head_dim == 64 ? attend_bf16_kv8_64 : head_dim == 128 ? attend_bf16_kv8_128 : attend_bf16_kv8_any;
    return run(attend, sizeof(bf16), q, q_seq_stride, k_cache, v_cache, k_scales, v_scales, block_tables,
               context_lens, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);
}
