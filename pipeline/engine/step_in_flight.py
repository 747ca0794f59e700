"""Overlapped steps (EngineConfig.overlap_steps, on by default on CUDA): a step's sampled
tokens stay on the device while the next step is scheduled and launched, its decode rows
taking those tokens as their input there (model_runner.PendingInputs); only then does the
host wait for them, and append them, check stops and retire what finished, while the device
runs the step after. So the host's per-step work (scheduling, layout, bookkeeping: a few
ms at 256 sequences, benchmarks/host_step.py) runs beside the device's instead of between
its steps. Until a token comes back its place holds PENDING_TOKEN; a sequence that turns
out to have finished has run one row too many, which is dropped. Steps overlap only while
every sequence that runs or may be admitted needs nothing of its newest token on the host
before the next forward (`can_overlap`: no prompt logprobs, drafts or pooling, and no
n > 1 request about to fork its choices; penalties count a pending token on the device,
logprobs come back with their tokens); otherwise the step in flight is read back first.
A step with a grammar reads the step before back once its own forward is launched, and
only then masks and samples: the matchers' work runs beside the forward. Greedy and seeded
output is the same token for token.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.engine import clock
from pipeline.engine.output_processor import OutputProcessor
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence
from pipeline.layers.sampler import Sampler
from pipeline.request import RequestOutput


def can_overlap(scheduler: Scheduler) -> bool:
    """Whether every running sequence, and every waiting one this step may admit, can have
    its next step launched before its newest token is read (Sequence.overlaps), and none
    forks its other choices this step (n > 1: the forks are made once the prompt's token is
    read; from then on they overlap like any other)."""
    room = max(0, scheduler.max_num_seqs - len(scheduler.running))
    return (all(seq.overlaps and not seq.num_forks for seq in scheduler.running)
            and all(seq.overlaps and not seq.num_forks for seq in itertools.islice(scheduler.waiting, room)))


@dataclass(slots=True)
class StepInFlight:
    """A launched step whose sampled tokens the host has not read: its sampling sequences,
    their tokens on the device, and a host copy of what comes back (the tokens, or the
    sampler's flat tokens-and-logprobs and its `unpack`), complete once `copied` has fired
    (CUDA; on a CPU the device's tensor is the host copy)."""
    sampling: list[Sequence]
    tokens: torch.Tensor
    host_values: torch.Tensor
    unpack: Callable[[list], list[int]] | None = None
    copied: object = None   # torch.cuda.Event

    @classmethod
    def launch(cls, sampler: Sampler, sampling: list[Sequence], logits: torch.Tensor,
               previous: StepInFlight | None) -> StepInFlight:
        """Sample the step's tokens on the device (penalties count `previous`'s, still there)
        and start their copy to the host; their places hold PENDING_TOKEN until read back."""
        tokens = sampler.draw(logits, sampling, previous.tokens if previous is not None else None)
        values, unpack = tokens, None
        if any(seq.logprobs is not None for seq in sampling):   # they come back with the tokens
            values, unpack = sampler.with_logprobs(logits, tokens, sampling)
        if values.device.type != "cuda":
            launched = cls(sampling, tokens, values, unpack)
        else:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            launched = cls(sampling, tokens, host, unpack, copied)
        for row, seq in enumerate(sampling):
            if seq.is_finished:
                continue   # by the step read back before its mask: this row is dropped
            seq.add_pending()
            seq.pending_row = row
        return launched

    def read_back(self, output: OutputProcessor) -> list[RequestOutput]:
        """Wait for the tokens, put them in their places and retire the sequences they finished."""
        if self.copied is not None:
            self.copied.synchronize()   # this step's values only: the step after it keeps running
        values = self.host_values.tolist()
        tokens = values if self.unpack is None else self.unpack(values)
        now = clock.now()
        finished = []
        for seq, token in zip(self.sampling, tokens):
            if seq.is_finished:
                continue   # retired while its token was in flight (a timeout, an abort)
            out = output.resolve(seq, token, now)
            if out is not None:
                finished.append(out)
        return finished
