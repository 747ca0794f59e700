/* Decode attention over the paged KV cache, on the CPU, in float32.
 *
 * One query token per sequence attends to its own cache blocks, read in place: no
 * gathered copy of the keys and values is ever made. On a CPU, decode attention is
 * bound by memory traffic (every step reads each sequence's whole context); this
 * kernel reads it exactly once. Work items are (sequence, kv head) pairs, each
 * handling its group of query heads so that every key and value row is loaded once
 * for the whole group (grouped-query attention).
 *
 * Layouts (all contiguous):
 *   q              [num_seqs, num_heads, head_dim], sequences q_seq_stride floats apart
 *   out            [num_seqs, num_heads, head_dim]
 *   k_cache, v_cache [num_blocks, num_kv_heads, block_size, head_dim]  (one layer)
 *   block_tables   [num_seqs, max_blocks]   int32, the blocks of each sequence in order
 *   context_lens   [num_seqs]               int32, tokens each sequence attends to
 *
 * Built by pipeline/kernels/__init__.py with the system C compiler and OpenMP; it
 * shares PyTorch's OpenMP runtime, so it uses the same threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline void prefetch(const float *p, size_t n) {
    for (size_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}

/* Eight floats: GCC/Clang vector extensions compile to AVX, SSE or NEON alike. aligned(4)
 * lets a vector be loaded from any float address. */
typedef float vec8 __attribute__((vector_size(32), aligned(4)));
#define LANES 8

static inline float hsum(vec8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One (sequence, kv head) pair: its `group` query heads against its `len` cached tokens.
 * head_dim is a multiple of 8. Always inlined into callers that fix head_dim, so the loops
 * over it unroll into registers. The loops are ordered for independent dependency chains:
 * one chain per token for the scores, one per vector of the output for the values. */
static inline __attribute__((always_inline)) void attend_one(
        const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
        const int32_t *restrict blocks, int len, float *restrict out, int group, int num_kv_heads,
        int kv_head, const int head_dim, int block_size, float scale,
        float *restrict scores /* [group, len] */) {
    const int nvec = head_dim / LANES;
    const size_t block_stride = (size_t)num_kv_heads * block_size * head_dim;
    const size_t head_offset = (size_t)kv_head * block_size * head_dim;
    const size_t slab = (size_t)block_size * head_dim;   /* floats of one head in a block */

    /* Scores: q . k for every token of the context, four tokens at a time. Blocks lie
     * anywhere in the pool and hardware prefetchers stop at their edges, so fetch the next
     * block's keys (and this block's values, read in the second pass) meanwhile. */
    for (int pos = 0; pos < len; pos += block_size) {
        const float *k = k_cache + (size_t)blocks[pos / block_size] * block_stride + head_offset;
        const float *k_next = pos + block_size < len
            ? k_cache + (size_t)blocks[pos / block_size + 1] * block_stride + head_offset : NULL;
        const float *v_here = v_cache + (size_t)blocks[pos / block_size] * block_stride + head_offset;
        const int n = len - pos < block_size ? len - pos : block_size;
        if (n < 4) {
            if (k_next) prefetch(k_next, slab);
            prefetch(v_here, slab);
        }
        for (int g = 0; g < group; g++) {
            const vec8 *qv = (const vec8 *)(q + (size_t)g * head_dim);
            float *srow = scores + (size_t)g * len + pos;
            int t = 0;
            for (; t + 4 <= n; t += 4) {
                if (g == 0) {   /* spread the prefetches: a burst would stall on fill buffers */
                    if (k_next) prefetch(k_next + (size_t)t * head_dim, 4 * (size_t)head_dim);
                    prefetch(v_here + (size_t)t * head_dim, 4 * (size_t)head_dim);
                }
                const vec8 *k0 = (const vec8 *)(k + (size_t)t * head_dim);
                const vec8 *k1 = k0 + nvec, *k2 = k1 + nvec, *k3 = k2 + nvec;
                vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int j = 0; j < nvec; j++) {
                    vec8 x = qv[j];
                    a0 += x * k0[j]; a1 += x * k1[j]; a2 += x * k2[j]; a3 += x * k3[j];
                }
                srow[t] = hsum(a0) * scale; srow[t + 1] = hsum(a1) * scale;
                srow[t + 2] = hsum(a2) * scale; srow[t + 3] = hsum(a3) * scale;
            }
            for (; t < n; t++) {
                const vec8 *k0 = (const vec8 *)(k + (size_t)t * head_dim);
                vec8 a0 = {0};
                for (int j = 0; j < nvec; j++) a0 += qv[j] * k0[j];
                srow[t] = hsum(a0) * scale;
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
            const float *v = v_cache + (size_t)blocks[pos / block_size] * block_stride + head_offset;
            const int n = len - pos < block_size ? len - pos : block_size;
            for (int t = 0; t < n; t++) {
                const vec8 *vrow = (const vec8 *)(v + (size_t)t * head_dim);
                const float w = p[pos + t];
                for (int j = 0; j < nvec; j++) acc[j] += w * vrow[j];
            }
        }
        const float inv = 1.0f / denom[g];
        vec8 *o = (vec8 *)(out + (size_t)g * head_dim);
        for (int j = 0; j < nvec; j++) o[j] = acc[j] * inv;
    }
}

#define ATTEND_WITH_HEAD_DIM(D)                                                                   \
    static void attend_##D(const float *q, const float *k, const float *v, const int32_t *b,      \
                           int len, float *out, int group, int kvh, int h, int hd, int bs,          \
                           float scale, float *scores) {                                           \
        (void)hd;                                                                                  \
        attend_one(q, k, v, b, len, out, group, kvh, h, D, bs, scale, scores);                     \
    }
ATTEND_WITH_HEAD_DIM(64)
ATTEND_WITH_HEAD_DIM(128)

static void attend_any_multiple_of_8(const float *q, const float *k, const float *v, const int32_t *b, int len,
                       float *out, int group, int kvh, int h, int hd, int bs, float scale,
                       float *scores) {
    attend_one(q, k, v, b, len, out, group, kvh, h, hd, bs, scale, scores);
}

/* Returns 0, -1 when scratch memory could not be allocated, -2 when head_dim is not a
 * multiple of 8 (callers check that first). */
int paged_decode_attention(const float *q, int64_t q_seq_stride, const float *k_cache,
                           const float *v_cache, const int32_t *block_tables, const int32_t *context_lens, float *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int max_blocks, float scale) {
    if (head_dim % LANES != 0) return -2;
    const int group = num_heads / num_kv_heads;
    void (*attend)(const float *, const float *, const float *, const int32_t *, int, float *, int,
                   int, int, int, int, float, float *) =
        head_dim == 64 ? attend_64 : head_dim == 128 ? attend_128 : attend_any_multiple_of_8;
    int failed = 0;
#pragma omp parallel for schedule(dynamic)
    for (int item = 0; item < num_seqs * num_kv_heads; item++) {
        int s = item / num_kv_heads, h = item % num_kv_heads;
        int len = context_lens[s];
        float *scores = malloc(sizeof(float) * (size_t)group * (len > 0 ? len : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        size_t head = (size_t)h * group * head_dim;   /* first query head of this kv head */
        attend(q + (size_t)s * q_seq_stride + head, k_cache, v_cache, block_tables + (size_t)s * max_blocks,
               len, out + (size_t)s * num_heads * head_dim + head, group, num_kv_heads, h, head_dim,
               block_size, scale, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
