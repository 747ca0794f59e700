"""A request into the engine: its Sequence, checked against what the model, the grammar
engine and the KV cache can do, and queued; or, for one that can never run, its error
results at once, one per choice (a bad template or tokenizer failure fails that request
only)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.engine import clock
from pipeline.engine.sequence import Sequence
from pipeline.layers.pooler import Pooler
from pipeline.models.pooling_config import read_pooling_config
from pipeline.prompts import vocabulary_error
from pipeline.request import FinishReason, Request, RequestOutput

if TYPE_CHECKING:
    from pipeline.engine.engine import Engine


def admit(engine: Engine, request: Request, prompt_ids: list[int] | Exception, arrival: float) -> list[RequestOutput]:
    """Queue the request's sequence and return [], or return its error results."""
    try:
        if isinstance(prompt_ids, Exception):
            raise prompt_ids   # prompts_token_ids caught it for this request
        if (error := vocabulary_error(prompt_ids, engine.structured.vocab_size)) is not None:
            return error_outputs(request, error, len(prompt_ids), arrival)
        seq = Sequence(request.id, prompt_ids, request.params, engine.output.detokenizer(prompt_ids, request.params),
                       arrival, timeout_s=request.timeout_s, pooling=request.pooling)
    except Exception as e:
        return error_outputs(request, f"tokenisation failed: {e}", 0, arrival)
    error = _error(engine, request, seq)
    if error is not None:
        return error_outputs(request, error, len(prompt_ids), arrival)
    seq.overlaps = engine.overlap_steps and seq.prompt_logprobs is None and seq.pooling is None
    engine.scheduler.add(seq)
    return []


def _error(engine: Engine, request: Request, seq: Sequence) -> str | None:
    """Why seq can never run, or None: then it is ready to queue (its grammar's matcher made,
    the pooler built for an embedding)."""
    if request.pooling is not None:
        error = _embedding_error(engine, seq)
        if error is not None:
            return error
    vocab_size = engine.structured.vocab_size
    bias = request.params.logit_bias
    if bias and max(bias) >= vocab_size:
        return f"logit_bias names token {max(bias)}; the model's vocabulary has {vocab_size} tokens"
    if request.params.structured_output is not None:
        try:
            seq.matcher = engine.structured.matcher(request.params.structured_output)
        except ValueError as e:
            return str(e)
    return engine.scheduler.admission_error(seq)


def _embedding_error(engine: Engine, seq: Sequence) -> str | None:
    """Why an embedding request cannot run, or None (then the pooler is ready for it)."""
    if seq.params.n != 1 or seq.params.structured_output is not None:
        return "an embedding request has one answer and no grammar (n = 1, no structured output)"
    if not seq.prompt_token_ids:
        return "an embedding request needs at least one token"
    dims = seq.pooling.dimensions
    if dims is not None and dims > engine.hidden_size:
        return f"dimensions {dims} exceeds the model's {engine.hidden_size}"
    runner = engine.runner
    if runner.pooler is None:
        try:
            runner.pooler = Pooler(read_pooling_config(engine.model_dir, decoder=True))
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
