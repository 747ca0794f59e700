"""Pooling a sequence's hidden states into one embedding vector, chunk by chunk.

A prompt may be computed over several steps (chunked prefill), so the pooler keeps what
each step contributes on the sequence (`Sequence.pooled`, on the device): the last
token's row once the prompt is done, the first token's row (cls), or the running sum of
every row (mean). Nothing is read back here: finish() turns the finished sequences'
vectors into lists with one transfer for them all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pipeline.models.pooling_config import PoolingConfig   # read by the engine, from the model's files


class Pooler:
    def __init__(self, config: "PoolingConfig"):
        self.config = config

    @property
    def reads_every_position(self) -> bool:
        """Whether every prompt position's hidden state is needed (no prefix cache then):
        all but last-token pooling."""
        return self.config.method != "last"

    def collect(self, hidden: torch.Tensor, seqs, num_new: list[int]) -> list:
        """Take this step's contribution of each pooling sequence from hidden [tokens, H]
        (the step's packed rows, in seqs' order); returns the sequences whose prompt is now
        complete (their `pooled` holds the vector, a mean still to be divided)."""
        method, done, base = self.config.method, [], 0
        for seq, n in zip(seqs, num_new):
            start = seq.num_computed_tokens
            if seq.pooling is not None:
                finishing = start + n >= seq.num_tokens
                if method == "mean":
                    part = hidden[base:base + n].float().sum(0)
                    seq.pooled = part if start == 0 or seq.pooled is None else seq.pooled + part
                elif method == "cls" and start == 0:
                    seq.pooled = hidden[base].float()
                elif method == "last" and finishing:
                    seq.pooled = hidden[base + n - 1].float()
                if finishing:
                    done.append(seq)
            base += n
        return done

    def finish(self, seqs) -> list[list[float]]:
        """The finished sequences' vectors as lists: a mean divided by the prompt's length, cut
        to the request's dimensions, then normalised (when the model normalises)."""
        vectors = []
        for seq in seqs:
            vectors.append(seq.pooled / seq.num_prompt_tokens if self.config.method == "mean" else seq.pooled)
            seq.pooled = None
        return as_lists(vectors, [seq.pooling.dimensions for seq in seqs], self.config.normalize)


def as_lists(vectors, dims: list[int | None], normalize: bool) -> list[list[float]]:
    """Pooled vectors (float32, on the device) as lists: each cut to its dimensions (None: all),
    then made unit length when the model normalises; one transfer for them all.

    When every vector keeps the same dimensions (a batch's usual case) they are cut and
    normalised as one matrix: a few ops for the batch instead of a few a row (on a GPU, a
    kernel launch each; on a CPU, 25 -> 8 us a 384-wide row). Row by row and as a matrix give
    the same bits on a CPU (each row is reduced alone either way; checked by the tests)."""
    if dims and all(d == dims[0] for d in dims):
        matrix = vectors if isinstance(vectors, torch.Tensor) else torch.stack(list(vectors))
        matrix = matrix[:, :dims[0]]
        return (F.normalize(matrix, dim=1) if normalize else matrix).tolist()
    rows = [vector[:d] for vector, d in zip(vectors, dims)]
    if normalize:
        rows = [F.normalize(row, dim=0) for row in rows]
    values = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).tolist()
    return [value[:row.shape[0]] for value, row in zip(values, rows)]
