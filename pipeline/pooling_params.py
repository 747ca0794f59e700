"""Per-request embedding settings: a request with PoolingParams asks for a vector, not text."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """An embedding request: its prompt is computed once (no decode, no sampling) and its
    hidden states pooled into one vector, the way the model's directory says
    (pipeline.models.pooling_config). dimensions: keep only the first this many of the
    vector's components (Matryoshka truncation), made unit length again when the model
    normalises; None keeps them all."""
    dimensions: int | None = None

    def __post_init__(self):
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}")
