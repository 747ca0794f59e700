"""n > 1 (SamplingParams.n): a request runs as its first choice until its prompt is
computed; then its other choices are forked from it, sharing its KV blocks
(scheduler.fork), each drawing its own tokens from then on."""
from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence


def fork_choices(sampling: list[Sequence], logits: torch.Tensor, scheduler: Scheduler,
                 detokenizer: Callable[[list[int], object], IncrementalDetokenizer]
                 ) -> tuple[list[Sequence], torch.Tensor]:
    """Fork the other choices of the n > 1 requests whose prompt was just computed. Those
    that run now sample from their first choice's logits row, each drawing its own token;
    returns the sampling sequences and their logits rows, the forks beside their parent."""
    order, rows, row = [], [], 0
    for seq in sampling:
        width = 1 + len(seq.draft_token_ids)
        order.append(seq)
        rows.extend(range(row, row + width))
        if seq.num_forks:   # a prompt just computed: one row, no drafts
            children = [seq.fork(choice, detokenizer(seq.prompt_token_ids, seq.params))
                        for choice in range(1, seq.num_forks + 1)]
            seq.num_forks = 0
            for child in children:
                child.overlaps = seq.overlaps
            if seq.matcher is not None:   # no token consumed yet: a copy is a fresh matcher
                for child in children:
                    child.matcher = seq.matcher.deep_copy()
            for child in scheduler.fork(seq, children):
                order.append(child)
                rows.append(row)
        row += width
    return order, logits.index_select(0, torch.tensor(rows, device=logits.device))
