"""How long a job will take, estimated before it runs (`--dry-run`, jobs.dry_run).

The estimate is of the job's wall time in the ledger (its first claim to its end, the
engine's load not counted), from the work left to compute: the prompts not reused, and each
answer's expected length: min(its own length, max_tokens), the lengths of the answers that
recent jobs of the engine ended by themselves (EOS, a stop) standing for its own, or
max_tokens without such history (a ceiling). Where the job's engine is built here
(`pipeline run`), it is measured: built, and a few steps timed at batch sizes 1 and the
job's, at a long context, and a prompt chunk (a step costs a fixed part plus a part per
sequence, per context token and per prompt token: on a CPU a token of a batch of 4 costs
about four times one of a batch of 64). The job's steps then come from its requests laid
out on the engine's max_num_seqs slots as continuous batching runs them. Elsewhere (`pipeline
submit`: the workers' engines) the tokens are divided by the median throughput of the last
completed jobs of the same engine key.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import time
from array import array
from dataclasses import dataclass

from jobs.ledger.models import Job

HISTORY_ROWS = 200_000   # at most this many of the recent answers' lengths are read
CALIBRATION_STEPS = 8    # decode steps timed at each batch size
CALIBRATION_CONTEXT = 512   # the context of the decode steps that time attention's share
_GOLDEN = (5 ** 0.5 - 1) / 2


class AnswerLengths:
    """How long answers run, from recent answers of the engine: one whose cap is m is
    expected to be min(X, m) tokens long, X drawn from the lengths of those that ended by
    themselves (EOS, a stop string, the grammar) and counted as reaching m for those that
    reached their own cap (they might have gone on). Without history: m, the ceiling."""

    def __init__(self, ended: list[int], capped: int):
        self.ended = sorted(ended)
        self.capped = capped
        self.count = len(self.ended) + capped
        self._prefix = list(itertools.accumulate(self.ended, initial=0))
        self._memo: dict[int, float] = {}

    @classmethod
    def of(cls, jobs: list[Job]) -> "AnswerLengths":
        import pyarrow.compute as pc   # pyarrow: only with history

        from jobs.results.parquet_files import read_results

        ended, capped = [], 0
        for job in jobs:
            try:
                table = read_results(job.results_path, columns=["finish_reason", "output_tokens", "reused_from"])
            except (OSError, ValueError):   # its results are gone (gc): nothing to learn from it
                continue
            computed = pc.is_null(table["reused_from"])   # not an answer computed for another job
            reason = table["finish_reason"]
            ended += table["output_tokens"].filter(pc.and_(computed, pc.equal(reason, "stop"))).to_pylist()
            capped += pc.sum(pc.and_(computed, pc.equal(reason, "length"))).as_py() or 0
            if len(ended) + capped >= HISTORY_ROWS:
                break
        return cls(ended, capped)

    def expected(self, cap: int) -> float:
        """The mean length of an answer capped at cap."""
        if not self.count:
            return cap
        if cap not in self._memo:
            below = bisect.bisect_left(self.ended, cap)   # those that ended before reaching cap
            self._memo[cap] = (self._prefix[below] + cap * (self.count - below)) / self.count
        return self._memo[cap]

    def at(self, share: float, cap: int) -> int:
        """The length of an answer capped at cap that `share` (0..1) of answers are shorter
        than: laid out at shares spread over 0..1, answers are as long as history's, the
        longest included (a job's last steps wait for its longest answers)."""
        k = int(share * self.count)
        return min(self.ended[k], cap) if k < len(self.ended) else cap


@dataclass
class StepCosts:
    """An engine step's cost in seconds: per_step, plus per_token for each sequence decoding
    in it and per_context_token for each token of its context (attention reads them all:
    a batch of 16 at 512 tokens took twice the step of one at 8 on a 2-core EPYC), plus
    per_prompt_token for each prompt token computed in it; and the engine's batch: slots
    (max_num_seqs) and batch_tokens (max_num_batched_tokens) a step at most."""
    per_step: float
    per_token: float
    per_context_token: float
    per_prompt_token: float
    slots: int
    batch_tokens: int


class Work:
    """The engine requests left to compute: prompt tokens, answer ceiling and answers each
    (compact arrays: a million lines take a few MB)."""

    def __init__(self):
        self.prompts, self.caps, self.answers = array("l"), array("l"), array("l")
        self.prompt_tokens = 0
        self.sequences = 0

    def add(self, parts) -> None:
        for prompt, cap, answers in parts:
            self.prompts.append(prompt)
            self.caps.append(cap)
            self.answers.append(answers)
            self.prompt_tokens += prompt
            self.sequences += answers

    def expected_output_tokens(self, lengths: AnswerLengths) -> float:
        return sum(answers * lengths.expected(cap) for cap, answers in zip(self.caps, self.answers) if answers)

    def seconds(self, costs: StepCosts, lengths: AnswerLengths) -> float:
        """The job's steps as continuous batching makes them: each answer takes a slot (of
        max_num_seqs) from its prompt's step until it ends, first come first served, and is
        as long as history's answers at shares spread over 0..1 (the golden ratio's
        multiples: long and short ones mixed as they come); a step holds at most
        max_num_batched_tokens, prompt chunks beside the decodes."""
        free = [0.0] * costs.slots   # when each slot frees, in steps
        decoded = context = 0.0
        answer = 0
        for prompt, cap, answers in zip(self.prompts, self.caps, self.answers):
            for _ in range(answers):
                answer += 1
                length = lengths.at((answer * _GOLDEN) % 1.0, cap)
                heapq.heapreplace(free, free[0] + length)
                decoded += length
                context += length * (prompt + length / 2)   # its context summed over its steps
        steps = max(max(free), (self.prompt_tokens + decoded) / costs.batch_tokens)
        return (steps * costs.per_step + decoded * costs.per_token + context * costs.per_context_token
                + self.prompt_tokens * costs.per_prompt_token)

    @property
    def mean_prompt(self) -> int:
        return self.prompt_tokens // max(1, len(self.prompts))


def measure_step_costs(engine_options: dict, work: Work) -> StepCosts | None:
    """The step costs of the engine engine_options build here, measured on it (built for
    the measurement, then freed): decode steps timed at batch 1 and at the job's batch, and
    a step computing one prompt chunk. None if the engine cannot be built or measured (the
    run would say why)."""
    from pipeline.config import EngineConfig
    from pipeline.engine.factory import build_engine

    try:
        engine = build_engine(EngineConfig(**engine_options))
        slots, batch_tokens = engine.max_num_seqs, engine.scheduler.max_num_batched_tokens
        batch = max(1, min(slots, work.sequences))
        one = _decode_step_s(engine, 1, 8)
        per_token = max(0.0, (_decode_step_s(engine, batch, 8) - one) / (batch - 1)) if batch > 1 else 0.0
        per_step = max(0.0, one - per_token)
        # four sequences with long contexts against four with short ones: attention's share
        context = max(16, min(CALIBRATION_CONTEXT, engine.max_model_len - CALIBRATION_STEPS - 8))
        per_context_token = max(0.0, (_decode_step_s(engine, 4, context) - _decode_step_s(engine, 4, 8))
                                / (4 * (context - 8)))
        chunk = max(1, min(batch_tokens, max(work.mean_prompt, 64), engine.max_model_len - 2))
        per_prompt_token = max(0.0, (_prompt_step_s(engine, chunk) - per_step) / chunk)
    except (OSError, RuntimeError, ValueError):
        return None
    return StepCosts(per_step, per_token, per_context_token, per_prompt_token, slots, batch_tokens)


def _calibration_ids(engine, n: int, salt: int) -> list[int]:
    """n token ids of the vocabulary, distinct per salt (no prefix cached from another measurement)."""
    vocab = engine.structured.vocab_size
    return [(salt * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]


def _decode_step_s(engine, batch: int, context: int) -> float:
    """Seconds of a decode step of `batch` sequences with prompts of `context` tokens (once
    the prompts are computed and one step warmed up)."""
    from pipeline.request import Request
    from pipeline.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=CALIBRATION_STEPS + 4, ignore_eos=True)
    requests = [Request(f"calibration-{batch}-{context}-{i}", params=params,
                        prompt_token_ids=_calibration_ids(engine, context, batch * 1000 + context * 7 + i))
                for i in range(batch)]
    try:
        for errors in engine.add_requests(requests):
            if errors:
                raise RuntimeError(f"the engine refused a calibration request: {errors[0].error}")
        while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.unfinished()):
            engine.step()   # the prompts, in as many chunks as they take
        engine.step()   # one decode step to warm up
        start = time.perf_counter()
        for _ in range(CALIBRATION_STEPS):
            engine.step()
        return (time.perf_counter() - start) / CALIBRATION_STEPS
    finally:
        engine.abort(r.id for r in requests)


def _prompt_step_s(engine, tokens: int) -> float:
    """Seconds of a step computing a prompt of `tokens` tokens in one chunk."""
    from pipeline.request import Request
    from pipeline.sampling_params import SamplingParams

    request = Request("calibration-prompt", prompt_token_ids=_calibration_ids(engine, tokens, 99_991),
                      params=SamplingParams(temperature=0.0, max_tokens=1))
    try:
        (errors,) = engine.add_requests([request])
        if errors:
            raise RuntimeError(f"the engine refused a calibration request: {errors[0].error}")
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start
    finally:
        engine.abort([request.id])
