"""Embedding with an encoder (BERT-family sentence-transformers models): the same interface
as the decoder Engine (add_request / step / abort / generate), so EngineLoop, the workers and
`pipeline run` drive it unchanged.

Encoders attend both ways and keep no KV cache, so there is nothing to page: each step takes
a batch of the waiting inputs, longest first, as many as fit the token budget
(max_num_batched_tokens counts padded tokens) and runs it through transformers' own model
(AutoModel) in one padded call. Taking inputs of nearly one length together keeps the
padding small: inputs are not cut into fixed-size batches in arrival order. Pooling and
normalisation come from the directory's sentence-transformers files (mean by default).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from pipeline.config import EngineConfig
from pipeline.device import resolve_device, resolve_dtype
from pipeline.engine import memory_budget
from pipeline.engine.generation import generate
from pipeline.layers.pooler import as_lists
from pipeline.models.loader import load_tokenizer, read_hf_config, resolve_model_dir
from pipeline.models.model_dir import context_length
from pipeline.models.pooling_config import read_pooling_config
from pipeline.prompts import prompt_token_ids, prompts_token_ids, vocabulary_error
from pipeline.request import FinishReason, Request, RequestOutput


_NO_CHATS = "an encoder embeds text (prompt) or token ids, not chat messages"


class _Waiting:
    """The encoder's queue, with the fields the engine loop and the metrics read of a scheduler."""

    def __init__(self):
        self.waiting: deque = deque()
        self.running: list = []       # an encoder step starts and ends its batch
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting)

    def abort(self, ids: set[str]) -> None:
        self.waiting = deque(item for item in self.waiting if item[0].id not in ids)

    def abort_all(self) -> None:
        self.waiting.clear()


class EncoderEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoModel
        self.config = config
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        hf_config = read_hf_config(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, hf_config)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model = AutoModel.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device).eval()
        self.pooling = read_pooling_config(self.model_dir, decoder=False)
        self.hidden_size = hf_config["hidden_size"]
        self.vocab_size = hf_config["vocab_size"]
        self.max_model_len = context_length(self.model_dir, config.max_model_len)
        self.max_num_seqs = config.max_num_seqs or 256
        # Padded tokens a step: 1024 (the CPU default) measured best for all-MiniLM on a 2-core CPU
        # (26.6 texts/s against 22.8 at 4096 and 20.6 at 8192, 600 texts of 8..254 tokens).
        self.batch_tokens = max(memory_budget.max_num_batched_tokens(config, self.device), self.max_model_len)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.scheduler = _Waiting()
        self.block_manager = None   # no KV cache
        self.num_steps = 0

    @property
    def lookahead(self) -> int:
        """Inputs worth keeping queued: enough to sort a few batches' worth by length."""
        return 4 * self.max_num_seqs

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def generate(self, requests, should_stop=None):
        return generate(self, requests, should_stop)

    def tokenize(self, request: Request) -> list[int]:
        if request.messages is not None:
            raise ValueError(_NO_CHATS)
        return prompt_token_ids(self.tokenizer, prompt=request.prompt, token_ids=request.prompt_token_ids)

    def add_request(self, request: Request) -> list[RequestOutput]:
        return self.add_requests([request])[0]

    def tokenize_batch(self, requests: list[Request]) -> list[list[int] | Exception]:
        """As Engine.tokenize_batch."""
        return prompts_token_ids(self.tokenizer, requests)

    def add_requests(self, requests: list[Request], token_ids: list[list[int] | Exception] | None = None
                     ) -> list[list[RequestOutput]]:
        """As Engine.add_requests: each request's error results, [] for those queued; the
        texts tokenized together (tokenize_batch, unless token_ids gives its result)."""
        arrival = time.perf_counter()
        if token_ids is None:
            token_ids = self.tokenize_batch(requests)
        return [self._add(request, ids, arrival) for request, ids in zip(requests, token_ids)]

    def _add(self, request: Request, ids: list[int] | Exception, arrival: float) -> list[RequestOutput]:
        if request.pooling is None:
            return [_output(request, arrival, error=f"{self.model_dir.name} is an encoder: it embeds and cannot "
                                                    "generate text")]
        if request.messages is not None:
            return [_output(request, arrival, error=f"tokenisation failed: {_NO_CHATS}")]
        if isinstance(ids, Exception):
            return [_output(request, arrival, error=f"tokenisation failed: {ids}")]
        dims = request.pooling.dimensions
        error = (f"the input has {len(ids)} tokens; the model takes at most {self.max_model_len}"
                 if len(ids) > self.max_model_len else "an embedding request needs at least one token" if not ids
                 else f"dimensions {dims} exceeds the model's {self.hidden_size}" if dims and dims > self.hidden_size
                 else vocabulary_error(ids, self.vocab_size))
        if error is not None:
            return [_output(request, arrival, prompt_tokens=len(ids), error=error)]
        self.scheduler.waiting.append((request, ids, arrival))
        return []

    def abort(self, request_ids) -> None:
        self.scheduler.abort(set(request_ids))

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Embed one batch: the longest waiting inputs, as many as the padded token budget holds."""
        waiting = sorted(self.scheduler.waiting, key=lambda item: -len(item[1]))
        batch = []
        for item in waiting:
            if batch and (len(batch) + 1) * len(batch[0][1]) > self.batch_tokens or len(batch) == self.max_num_seqs:
                break
            batch.append(item)
        taken = {id(item) for item in batch}
        self.scheduler.waiting = deque(item for item in self.scheduler.waiting if id(item) not in taken)
        start = time.perf_counter()
        vectors = self._embed([ids for _, ids, _ in batch], [r.pooling.dimensions for r, _, _ in batch])
        self.num_steps += 1
        now = time.perf_counter()
        return [_output(request, arrival, prompt_tokens=len(ids), embedding=vector, started=start, now=now)
                for (request, ids, arrival), vector in zip(batch, vectors)]

    def _embed(self, inputs: list[list[int]], dims: list[int | None]) -> list[list[float]]:
        width = max(map(len, inputs))
        # Padded on the host as lists, then one tensor each (a row at a time cost 15 us a row).
        ids = torch.tensor([tokens + [self.pad_id] * (width - len(tokens)) for tokens in inputs])
        lengths = torch.tensor([len(tokens) for tokens in inputs])
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()   # [B, L, H]
        method = self.pooling.method
        if method == "mean":
            pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        elif method == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = hidden[torch.arange(len(inputs), device=self.device), mask.sum(1) - 1]
        return as_lists(pooled, dims, self.pooling.normalize)


def _output(request: Request, arrival: float, *, prompt_tokens: int = 0, embedding=None, error: str | None = None,
            started: float | None = None, now: float | None = None) -> RequestOutput:
    now = now or time.perf_counter()
    started = started or now
    return RequestOutput(id=request.id, text="", token_ids=[],
                         finish_reason=FinishReason.ERROR if error else FinishReason.STOP, error=error,
                         prompt_tokens=prompt_tokens, output_tokens=0, queue_s=started - arrival,
                         ttft_s=None if error else now - arrival, latency_s=now - arrival, embedding=embedding)
