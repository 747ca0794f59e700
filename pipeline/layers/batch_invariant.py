"""Batch-invariant inference: a request's tokens and logprobs that do not depend on what
else runs beside it (EngineConfig.batch_invariant).

A row's result changes with its neighbours only where a reduction's order follows the
shape of the batch. In this engine those are two:
- attention, where scaled_dot_product_attention tiles a prefill chunk by its length:
  the cpu backend then sends every row through the C kernel, in an order fixed by the
  row's position alone (pipeline/layers/attention/cpu.py);
- the linear layers, where MKL and oneDNN pick their kernels (and a split of the inner
  dimension) by the number of rows. Measured on an AVX-512 BF16 EPYC: MKL's float32
  product gives one result for 1-3 rows and another from 4 rows on; oneDNN's bfloat16
  down projection (1536 inputs) one for a single row and another from 2. From some row
  count on, a library keeps one kernel and order: below it, a call is padded with copies
  of its last row up to it. Which count that is differs by library, CPU and shape, so it is
  measured at load for each distinct layer shape (`measure_layer`), up to the largest
  call a step makes. A shape without such a count computes in tiles of exactly
  TILE_ROWS rows (a call of one fixed shape: one kernel, and a row's result depends
  neither on its place in the tile nor on the other rows, which is checked too).
  A measurement is kept on disk (cache_root()/batch_invariant.json, by torch version,
  thread count, CPU flags and shape): an LM head checked up to 1,024 rows takes seconds.
RMSNorm, rotary, SiLU, the sampler's softmax and the per-row KV-cache writes are per row
already. Where none of this holds (no C kernels, CUDA), the engine refuses the mode
rather than promise it.
"""
from __future__ import annotations

import hashlib
import json
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

LINEAR_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
PAD_CANDIDATES = (1, 2, 4, 8, 16)   # smallest row counts tried, in order
TILE_ROWS = 64
CHECKED_ROWS = 64   # rows each call size is compared on


class BatchInvariantLinear(nn.Module):
    """A linear layer whose every call has at least `min_rows` rows (copies of the last added), or,
    with `tile_rows`, is computed tile by tile of exactly that many rows."""

    def __init__(self, inner: nn.Module, in_features: int, out_features: int,
                 min_rows: int = 1, tile_rows: int | None = None):
        super().__init__()
        self.inner, self.in_features, self.out_features = inner, in_features, out_features
        self.min_rows, self.tile_rows = min_rows, tile_rows

    @property
    def weight(self):
        """The wrapped layer's (a tied LM head's is the embedding)."""
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if self.tile_rows is not None:
            out = torch.cat([self.inner(_padded(rows[i:i + self.tile_rows], self.tile_rows))
                             for i in range(0, m, self.tile_rows)])[:m] if m else self.inner(rows)
        elif 0 < m < self.min_rows:
            out = self.inner(_padded(rows, self.min_rows))[:m]
        else:
            out = self.inner(rows)
        return out.view(*x.shape[:-1], self.out_features)


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """rows and copies of its last row up to count rows: copies, not zeros, because a zero
    row is not a harmless input everywhere (bitsandbytes' int8 layer scales each row by its
    absolute maximum, and a zero row broke the real ones' answers)."""
    missing = count - rows.shape[0]
    return rows if missing == 0 else torch.cat([rows, rows[-1:].expand(missing, -1)])


def check_device(device: torch.device) -> None:
    """Refuse the mode where it has no kernels (before a model is loaded for nothing)."""
    if device.type != "cpu":
        raise ValueError("batch-invariant inference runs on the CPU only for now (no fixed-order CUDA kernels "
                         "yet): pass batch_invariant=False (pipeline: --no-batch-invariance) on a GPU")


def make_batch_invariant(model: nn.Module, backend, dtype: torch.dtype, device: torch.device,
                         max_rows: int) -> None:
    """Put the model and its attention backend in batch-invariant mode, or raise ValueError
    saying why it cannot be here. max_rows: the most rows a step gives a linear layer."""
    check_device(device)
    if not backend.can_be_batch_invariant(dtype):
        raise ValueError(f"batch-invariant inference needs the cpu attention backend's C kernels in float32 or "
                         f"bfloat16 (backend {backend.name!r}, {str(dtype).removeprefix('torch.')}; are gcc and the "
                         "Python headers installed?): pass batch_invariant=False")
    backend.batch_invariant = True
    plans: dict[tuple, tuple[int, int | None]] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in LINEAR_LAYERS or isinstance(child, BatchInvariantLinear):
                continue
            k, n = _features(child)
            key = (type(child), k, n)
            if key not in plans:
                plans[key] = _remembered(child, k, n, dtype, max_rows)
                log.info("batch-invariant %s %dx%d: %s", type(child).__name__, k, n,
                         f"tiles of {plans[key][1]} rows" if plans[key][1] else f"at least {plans[key][0]} rows a call")
            min_rows, tile_rows = plans[key]
            setattr(parent, name, BatchInvariantLinear(child, k, n, min_rows, tile_rows))


def _features(layer: nn.Module) -> tuple[int, int]:
    if hasattr(layer, "in_features"):
        return layer.in_features, layer.out_features
    weight = layer.weight
    return weight.shape[1], weight.shape[0]


def _remembered(layer: nn.Module, k: int, n: int, dtype: torch.dtype, max_rows: int) -> tuple[int, int | None]:
    """measure_layer's answer, kept on disk for this torch, thread count and CPU."""
    from pipeline.config import cache_root
    from pipeline.device import cpu_flags

    what = [torch.__version__, torch.get_num_threads(), sorted(cpu_flags()), type(layer).__name__, k, n,
            str(dtype), max_rows]
    key = hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]
    path = cache_root() / "batch_invariant.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return tuple(known[key])
    plan = measure_layer(layer, k, dtype, max_rows)
    known[key] = plan
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{key}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(path)   # atomic: concurrent engines never read half a file
    except OSError as e:
        log.info("could not keep the batch-invariance measurement in %s: %s", path, e)
    return plan


def row_counts(max_rows: int) -> list[int]:
    """Call sizes checked: every small one, the edges of common tiles, and the largest."""
    counts = {*range(1, 18), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, max_rows - 1, max_rows}
    return sorted(c for c in counts if 1 <= c <= max_rows)


@torch.inference_mode()
def measure_layer(layer: nn.Module, in_features: int, dtype: torch.dtype, max_rows: int) -> tuple[int, int | None]:
    """(min_rows, None) for the smallest padding that makes every call size checked give
    each row the bits it gets in the largest call; else (1, TILE_ROWS) if fixed tiles do.
    Raises ValueError if neither holds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(max(max_rows, TILE_ROWS), in_features, generator=gen).to(dtype)
    counts = row_counts(max_rows)
    for min_rows in PAD_CANDIDATES:
        candidate = BatchInvariantLinear(layer, in_features, -1, min_rows)
        if _agrees(candidate, x, counts):
            return min_rows, None
    tiled = BatchInvariantLinear(layer, in_features, -1, 1, TILE_ROWS)
    # Tiles: also a row's place in its tile, and the rows beside it, must not matter.
    shifted = torch.cat([torch.randn(5, in_features, generator=gen).to(dtype), x])
    if _agrees(tiled, x, counts) and torch.equal(tiled(shifted[:TILE_ROWS + 5])[5:], tiled(x[:TILE_ROWS])):
        return 1, TILE_ROWS
    raise ValueError(f"no batch-invariant way found for {type(layer).__name__} ({in_features} inputs) in "
                     f"{str(dtype).removeprefix('torch.')} on this CPU: pass batch_invariant=False")


def _agrees(layer: BatchInvariantLinear, x: torch.Tensor, counts: list[int]) -> bool:
    """Every call size gives the rows of the largest call's bits, over at least
    CHECKED_ROWS rows each: a different order in float32 changes a bfloat16 output only
    where it crosses a rounding boundary, one element in hundreds, so one row can pass."""
    largest = layer(x[:counts[-1]])
    for m in counts[:-1]:
        for start in range(0, max(min(CHECKED_ROWS, counts[-1]) - m, 0) + 1, m):
            if not torch.equal(layer(x[start:start + m]), largest[start:start + m]):
                return False
    return True
