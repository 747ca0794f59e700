"""Which device the engine runs on, and in which dtype ("auto" resolves both here).

dtype "auto" is the model's own dtype (config.json's `torch_dtype`, or `dtype` in
transformers >= 5) where the device computes it natively, otherwise float32:
- CUDA: bfloat16 where the GPU supports it (Ampere and later), float16 always. A float32
  checkpoint runs in bfloat16 where the GPU has it: float32 there has no FlashAttention
  and no CUDA graphs, and reads twice the bytes per step; bf16 keeps float32's exponent
  range (float16 would not, so a GPU without bf16 keeps float32).
- CPU: bfloat16 only with AVX-512 BF16 or AMX (measured on an AVX-512 BF16 EPYC: W1 in
  bf16 runs well above float32); without them PyTorch emulates bf16 and float32 is
  faster and exact. float16 on a CPU is emulated everywhere, so it becomes float32.
"""
from __future__ import annotations

import functools

import torch

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# /proc/cpuinfo flags that mean bf16 dot products in hardware.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no CUDA GPU is available; use device 'cpu'")
    return torch.device(name)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX-512 BF16 or AMX, from PyTorch's own CPU probe, else the kernel's CPU flags."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
              getattr(torch.cpu, "_is_amx_tile_supported", None))
    if any(probe is not None and probe() for probe in probes):
        return True
    flags = cpu_flags()
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def cpu_flags() -> frozenset[str]:
    """The kernel's CPU flags (/proc/cpuinfo), empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()


def computes_natively(dtype: torch.dtype, device: torch.device) -> bool:
    if dtype == torch.float32:
        return True
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return dtype == torch.bfloat16 and cpu_has_native_bf16()
    return False


def model_dtype(hf_config: dict) -> torch.dtype:
    """The dtype the checkpoint was saved in (float32 when the config does not say)."""
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return MODEL_DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def resolve_dtype(name: str, device: torch.device, hf_config: dict) -> torch.dtype:
    if name != "auto":
        return MODEL_DTYPES[name]
    dtype = model_dtype(hf_config)
    if dtype == torch.float32 and device.type == "cuda" and computes_natively(torch.bfloat16, device):
        return torch.bfloat16
    return dtype if computes_natively(dtype, device) else torch.float32
