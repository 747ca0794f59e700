/* bfloat16 <-> float32 for the bf16 kernels: bf16 is the top half of a float32, so
 * widening is a shift; narrowing rounds to nearest even, as PyTorch does (and a NaN
 * becomes PyTorch's 0x7fc0).
 * Plain integer arithmetic, so loops over it vectorise on any x86 or Arm CPU. */
#ifndef PIPELINE_BF16_H
#define PIPELINE_BF16_H
#include <stdint.h>

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 x) {
    union { uint32_t i; float f; } bits = {(uint32_t)x << 16};
    return bits.f;
}

static inline bf16 float_to_bf16(float x) {
    union { float f; uint32_t i; } bits = {x};
    if ((bits.i & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;   /* NaN: the canonical one, as PyTorch */
    return (bf16)((bits.i + 0x7fffu + ((bits.i >> 16) & 1u)) >> 16);
}

/* Eight floats (GCC/Clang vector extensions: AVX, SSE or NEON alike); aligned(4) and
 * aligned(2) let a vector be loaded from any float or bf16 address. */
typedef float vec8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t bf16x8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline vec8 load_bf16x8(const bf16 *p) {
    u32x8 wide = __builtin_convertvector(*(const bf16x8 *)p, u32x8) << 16;
    return (vec8)wide;
}

#endif
