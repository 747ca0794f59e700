"""A request into the engine: its Sequence, checked against what the model, the grammar
engine and the KV cache can do, and queued; or, for one that can never run, its error
results at once, one per choice (a bad template or tokenizer failure fails that request
only)."""
from __future__ import annotations

from pathlib import Path

from pipeline.engine import clock
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.output_processor import OutputProcessor
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence
from pipeline.layers.grammar_masks import StructuredOutputs
from pipeline.layers.pooler import Pooler
from pipeline.models.pooling_config import read_pooling_config
from pipeline.prompts import vocabulary_error
from pipeline.request import FinishReason, Request, RequestOutput


class Admission:
    """The engine's door: what a request is checked against (the vocabulary, the grammar
    engine, the pooler, the KV cache) and where its sequence goes (the scheduler)."""

    def __init__(self, scheduler: Scheduler, output: OutputProcessor, structured: StructuredOutputs,
                 runner: ModelRunner, model_dir: Path, hidden_size: int):
        self.scheduler, self.output, self.structured = scheduler, output, structured
        self.runner, self.model_dir, self.hidden_size = runner, model_dir, hidden_size

    def admit(self, request: Request, prompt_ids: list[int] | Exception, arrival: float,
              overlap_steps: bool) -> list[RequestOutput]:
        """Queue the request's sequence and return [], or return its error results."""
        try:
            if isinstance(prompt_ids, Exception):
                raise prompt_ids   # prompts_token_ids caught it for this request
            if (error := vocabulary_error(prompt_ids, self.structured.vocab_size)) is not None:
                return error_outputs(request, error, len(prompt_ids), arrival)
            seq = Sequence(request.id, prompt_ids, request.params, self.output.detokenizer(prompt_ids, request.params),
                           arrival, timeout_s=request.timeout_s, pooling=request.pooling)
            seq.think_opened = self.output.think_opened(request.messages is not None, prompt_ids)
        except Exception as e:
            return error_outputs(request, f"tokenisation failed: {e}", 0, arrival)
        error = self._error(request, seq)
        if error is not None:
            return error_outputs(request, error, len(prompt_ids), arrival)
        seq.overlaps = overlap_steps and seq.prompt_logprobs is None and seq.pooling is None
        self.scheduler.add(seq)
        return []

    def _error(self, request: Request, seq: Sequence) -> str | None:
        """Why seq can never run, or None: then it is ready to queue (its grammar's matcher
        made, the pooler built for an embedding)."""
        if request.pooling is not None:
            error = self._embedding_error(seq)
            if error is not None:
                return error
        vocab_size = self.structured.vocab_size
        bias = request.params.logit_bias
        if bias and max(bias) >= vocab_size:
            return f"logit_bias names token {max(bias)}; the model's vocabulary has {vocab_size} tokens"
        if request.params.structured_output is not None:
            try:
                seq.matcher = self.structured.matcher(request.params.structured_output)
            except ValueError as e:
                return str(e)
        return self.scheduler.admission_error(seq)

    def _embedding_error(self, seq: Sequence) -> str | None:
        """Why an embedding request cannot run, or None (then the pooler is ready for it)."""
        if seq.params.n != 1 or seq.params.structured_output is not None:
            return "an embedding request has one answer and no grammar (n = 1, no structured output)"
        if not seq.prompt_token_ids:
            return "an embedding request needs at least one token"
        dims = seq.pooling.dimensions
        if dims is not None and dims > self.hidden_size:
            return f"dimensions {dims} exceeds the model's {self.hidden_size}"
        runner = self.runner
        if runner.pooler is None:
            try:
                runner.pooler = Pooler(read_pooling_config(self.model_dir, decoder=True))
            except (OSError, ValueError) as e:
                return f"this model cannot embed: {e}"
        seq.reads_every_position = runner.pooler.reads_every_position
        return None


def error_outputs(request: Request, error: str, prompt_tokens: int, arrival: float) -> list[RequestOutput]:
    """The results of a request that cannot run, one per choice."""
    latency = clock.now() - arrival
    return [RequestOutput(id=request.id, text="", token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                          prompt_tokens=prompt_tokens, output_tokens=0, queue_s=0.0, ttft_s=None,
                          latency_s=latency, choice=choice)
            for choice in range(request.params.n)]
