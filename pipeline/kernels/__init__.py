"""Kernels that measurably beat the library: hand-written C for the CPU (cpu_kernels.py
builds them on first use with the system C compiler and holds their entry points), and
three Triton modules for CUDA, imported only there (cuda_kernels.py says which serves a
step): paged_decode_triton.py (decode attention for torch 2.10/2.11's varlen backend),
pointwise_triton.py (the layer's elementwise steps fused as the C kernels fuse them; fp8
linears' activation quantization) and fp8_matmul_triton.py (fp8 linears' product at
decode steps' row counts).

paged_attention.c: decode attention reading the paged KV cache in place.
quantize_rows.c: per-token uint8 quantization of a linear's input and the per-token
  scaling of its int8 product (w8a8 on oneDNN).
rms_norm.c: RMSNorm with the residual addition fused in.
rotary_cache.c: rotary embedding of q and k and the KV-cache write, in one pass.
silu_and_mul.c: SiLU of the gate times the up projection, in one pass.

Each has a float32 and a bfloat16 variant; the bf16 ones compute in float32 and round
once per output (bf16.h). Where no compiler works, `available()` is False and callers
take their PyTorch path; `PIPELINE_CPU_KERNELS=0` forces that path. They serve float32
and bfloat16 CPU tensors only.
"""
