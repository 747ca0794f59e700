"""The engine: schedule -> run the model -> sample -> retire, one step at a time.

An embedding request (Request.pooling) goes through the same batches as a prompt that is
never decoded: the step that computes its last prompt token pools its hidden states
(layers/pooler.py) and retires it, its blocks freed (the prefix cache may keep them).

    engine = Engine(EngineConfig(model="path/to/hf-dir"))
    for out in engine.generate(requests):   # each result as soon as it finishes
        ...

Overlapped steps (EngineConfig.overlap_steps, on by default on CUDA): a step's sampled
tokens stay on the device while the next step is scheduled and launched, its decode rows
taking those tokens as their input there (model_runner.PendingInputs); only then does the
host wait for them, and append them, check stops and retire what finished, while the device
runs the step after. So the host's per-step work (scheduling, layout, bookkeeping: a few
ms at 256 sequences, benchmarks/host_step.py) runs beside the device's instead of between
its steps. Until a token comes back its place holds PENDING_TOKEN; a sequence that turns
out to have finished has run one row too many, which is dropped. Steps overlap only while
every sequence that runs or may be admitted needs nothing of its newest token on the host
before the next forward (Sequence.overlaps: no prompt logprobs, drafts or pooling, and no
n > 1 request about to fork its choices; penalties count a pending token on the device,
logprobs come back with their tokens); otherwise the step in flight is read back first.
A step with a grammar reads the step before back once its own forward is launched, and
only then masks and samples: the matchers' work runs beside the forward. Greedy and seeded
output is the same token for token.
"""
from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from pipeline.config import EngineConfig
from pipeline.device import resolve_device, resolve_dtype
from pipeline.engine import memory_budget
from pipeline.engine.block_manager import BlockManager
from pipeline.engine.detokenizer import IncrementalDetokenizer
from pipeline.engine.generation import generate
from pipeline.engine.model_runner import ModelRunner
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence
from pipeline.engine.speculative import Speculator
from pipeline.layers import attention
from pipeline.layers.grammar_masks import StructuredOutputs
from pipeline.layers.kv_cache import KVCache
from pipeline.layers.packed_linear import pack_linear_layers
from pipeline.layers.pooler import Pooler
from pipeline.layers.quantization.modes import QUANTIZED_LAYERS, linear_quantizer, quantize, quantize_w8a8
from pipeline.layers.quantization.smoothing import calibration_requests
from pipeline.layers.sampler import Sampler
from pipeline.models.loader import load_model, load_tokenizer, read_hf_config, resolve_model_dir
from pipeline.models.pooling_config import read_pooling_config
from pipeline.prompts import prompt_token_ids, prompts_token_ids, vocabulary_error
from pipeline.request import FinishReason, Request, RequestOutput


@dataclass(slots=True)
class StepInFlight:
    """A launched step whose sampled tokens the host has not read (overlapped steps): its
    sampling sequences, their tokens on the device, and a host copy of what comes back (the
    tokens, or the sampler's flat tokens-and-logprobs and its `unpack`), complete once
    `copied` has fired (CUDA; on a CPU the device's tensor is the host copy)."""
    sampling: list[Sequence]
    tokens: torch.Tensor
    host_values: torch.Tensor
    unpack: Callable[[list], list[int]] | None = None
    copied: object = None   # torch.cuda.Event

    @classmethod
    def launch(cls, sampling: list[Sequence], tokens: torch.Tensor, values: torch.Tensor | None = None,
               unpack: Callable[[list], list[int]] | None = None) -> "StepInFlight":
        values = tokens if values is None else values
        if values.device.type != "cuda":
            return cls(sampling, tokens, values, unpack)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(sampling, tokens, host, unpack, copied)

    def token_ids(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()   # this step's values only: the step after it keeps running
        values = self.host_values.tolist()
        return values if self.unpack is None else self.unpack(values)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        self.dtype = dtype = resolve_dtype(config.dtype, self.device, read_hf_config(self.model_dir))
        self.tokenizer = load_tokenizer(self.model_dir)
        # Quantized while loading, one linear at a time, where the mode can (all but none, w8a8).
        quantize_linear = linear_quantizer(config.quantization, self.device, dtype)
        model, args = load_model(self.model_dir, dtype, self.device, quantize_linear, QUANTIZED_LAYERS)
        self.model = model if quantize_linear else quantize(model, config.quantization, self.device, dtype)
        self.hidden_size = args.hidden_size
        if config.pack_weights and config.quantization == "none":
            pack_linear_layers(self.model)   # CPU float32 and bfloat16; elsewhere it changes nothing
        self.eos_token_ids = self._eos_token_ids()

        self.max_num_seqs = memory_budget.max_num_seqs(config, self.device)
        kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else dtype
        self.attention_backend = backend = attention.select(config.attention_backend, self.device, dtype, kv_dtype,
                                                            (args.num_heads, args.num_kv_heads, args.head_dim))
        self.block_size = block_size = config.block_size or backend.default_block_size
        backend.check(block_size, dtype, kv_dtype, self.device)
        num_blocks = config.num_kv_blocks or KVCache.blocks_for_budget(
            memory_budget.kv_cache_bytes(config, self.device, args, dtype, self.max_num_seqs, backend.copies_layer_kv),
            args.num_layers, args.num_kv_heads, args.head_dim, block_size, kv_dtype)
        kv_cache = KVCache(args.num_layers, args.num_kv_heads, args.head_dim, block_size,
                           num_blocks, kv_dtype, self.device, backend)
        self.block_manager = BlockManager(num_blocks, block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        max_model_len = min(config.max_model_len or args.max_position_embeddings,
                            args.max_position_embeddings)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=memory_budget.max_num_batched_tokens(config, self.device),
                                   max_model_len=max_model_len)
        self.runner = ModelRunner(self.model, kv_cache, self.device, backend)
        self.runner.table_rows = self.block_manager.table_rows
        if config.cuda_graphs and self.device.type == "cuda" and backend.supports_cuda_graphs:
            from pipeline.engine.cuda_graphs import capture_decode_graphs
            self.runner.graphs = capture_decode_graphs(self.model, self.max_num_seqs, self.scheduler.max_model_len,
                                                       block_size, kv_cache.pad_block, self.device)
        # Admission in groups keeps most steps decode-only, where decode graphs replay them (scheduler.py).
        graphs_group = max(1, self.max_num_seqs // 8) if self.runner.graphs is not None else 1
        self.scheduler.admission_group = min(config.admission_group or graphs_group, self.max_num_seqs)
        self.sampler = Sampler(self.device)
        self.structured = StructuredOutputs(self.tokenizer, args.vocab_size, self.device)
        self._token_texts: dict[int, str] = {}   # logprobs: each token's text
        self.speculator = Speculator(config.speculative, config.num_speculative_tokens, self.sampler)
        overlap = config.overlap_steps if config.overlap_steps is not None else self.device.type == "cuda"
        self.overlap_steps = overlap and config.speculative == "none"   # drafts are proposed from the newest tokens
        self._in_flight: StepInFlight | None = None
        self.num_steps = 0
        self.num_overlapped_steps = 0   # steps launched before the one before them was read back
        if config.quantization == "w8a8":   # smoothed on its float model's ranges, so once the model runs
            quantize_w8a8(self.model, self._calibrate)

    def _calibrate(self) -> None:
        """Smoothing's calibration requests, one at a time so that every engine runs the same steps
        (the same ranges, bit for bit); their float KV blocks then leave the prefix cache."""
        fits = min(self.max_model_len, self.block_manager.num_blocks * self.block_size) - 1
        outs = [o for r in calibration_requests(self.tokenizer.encode, fits) for o in self.generate([r])]
        if any(o.error for o in outs):
            raise RuntimeError(f"w8a8 calibration failed: {next(o.error for o in outs if o.error)}")
        self.reset_prefix_cache()
        self.num_steps = self.scheduler.num_preemptions = 0

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (for example after a warm-up that must not count).
        Returns False, doing nothing, while requests are running."""
        return self.block_manager.reset_prefix_cache()

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        gen_config = self.model_dir / "generation_config.json"
        for source in (read_hf_config(self.model_dir),
                       json.loads(gen_config.read_text()) if gen_config.exists() else {}):
            eos = source.get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def tokenize(self, request: Request) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt=request.prompt, messages=request.messages, tools=request.tools,
                                token_ids=request.prompt_token_ids)

    def generate(self, requests: Iterable[Request],
                 should_stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
        """Yield each request's result as soon as it finishes (not in input order); see
        pipeline.engine.generation.generate."""
        return generate(self, requests, should_stop)

    @property
    def lookahead(self) -> int:
        """Requests worth keeping queued: as many again as a full batch, so that a finished
        sequence is replaced at once without pulling a huge input in all at once."""
        return 2 * self.max_num_seqs

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def add_request(self, request: Request) -> list[RequestOutput]:
        """Queue a request for the next steps (its id must be unique among the unfinished
        ones) and return []; a request that can never run gets its error results at once
        instead, one per choice."""
        return self.add_requests([request])[0]

    def add_requests(self, requests: list[Request]) -> list[list[RequestOutput]]:
        """add_request for each, their prompts tokenized together (prompts_token_ids):
        each request's error results, [] for those queued."""
        arrival = time.perf_counter()
        return [self._add(request, ids, arrival)
                for request, ids in zip(requests, prompts_token_ids(self.tokenizer, requests))]

    def _add(self, request: Request, prompt_ids: list[int] | Exception, arrival: float) -> list[RequestOutput]:
        try:   # a bad template or tokenizer failure fails this request only
            if isinstance(prompt_ids, Exception):
                raise prompt_ids   # prompts_token_ids caught it for this request
            if (error := vocabulary_error(prompt_ids, self.structured.vocab_size)) is not None:
                return _error_outputs(request, error, len(prompt_ids), arrival)
            seq = Sequence(request.id, prompt_ids, request.params, self._detokenizer(prompt_ids, request.params),
                           arrival, timeout_s=request.timeout_s, pooling=request.pooling)
        except Exception as e:
            return _error_outputs(request, f"tokenisation failed: {e}", 0, arrival)
        if request.pooling is not None:
            error = self._embedding_error(seq)
            if error is not None:
                return _error_outputs(request, error, len(prompt_ids), arrival)
        bias = request.params.logit_bias
        if bias and max(bias) >= self.structured.vocab_size:
            return _error_outputs(request, f"logit_bias names token {max(bias)}; the model's vocabulary has "
                                           f"{self.structured.vocab_size} tokens", len(prompt_ids), arrival)
        if request.params.structured_output is not None:
            try:
                seq.matcher = self.structured.matcher(request.params.structured_output)
            except ValueError as e:
                return _error_outputs(request, str(e), len(prompt_ids), arrival)
        error = self.scheduler.admission_error(seq)
        if error is not None:
            return _error_outputs(request, error, len(prompt_ids), arrival)
        seq.overlaps = self.overlap_steps and seq.prompt_logprobs is None and seq.pooling is None
        self.scheduler.add(seq)
        return []

    def _embedding_error(self, seq: Sequence) -> str | None:
        """Why an embedding request cannot run, or None (then the pooler is ready for it)."""
        if seq.params.n != 1 or seq.params.structured_output is not None:
            return "an embedding request has one answer and no grammar (n = 1, no structured output)"
        if not seq.prompt_token_ids:
            return "an embedding request needs at least one token"
        dims = seq.pooling.dimensions
        if dims is not None and dims > self.hidden_size:
            return f"dimensions {dims} exceeds the model's {self.hidden_size}"
        if self.runner.pooler is None:
            try:
                self.runner.pooler = Pooler(read_pooling_config(self.model_dir, decoder=True))
            except (OSError, ValueError) as e:
                return f"this model cannot embed: {e}"
        seq.reads_every_position = self.runner.pooler.reads_every_position
        return None

    def _detokenizer(self, prompt_ids: list[int], params) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these unfinished requests and free their blocks (unknown ids are ignored)."""
        self.scheduler.abort(set(request_ids))

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it (or timed out before it).
        Overlapped, it launches a step and returns those the step before it finished."""
        finished = self._retire_timed_out()
        overlap = self.overlap_steps and self._all_overlap()
        if self._in_flight is not None and not overlap:   # this step needs its tokens on the host
            finished += self._read_back()
        if not self.scheduler.num_unfinished:
            self._in_flight = None   # every sequence in it finished: its rows are dropped
            return finished
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self._in_flight is not None:   # only sequences whose pending token is their last
                return finished + self._read_back()
            raise RuntimeError("scheduler produced an empty step with work pending")
        now = time.perf_counter()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        try:
            self.runner.copy_blocks(self.block_manager.take_copies())   # forked choices' copies on write
            step = self.runner.run(batch, self._in_flight.tokens if self._in_flight is not None else None)
        except BaseException:
            # This step's full blocks were already made findable; their content may now
            # never have been written. Drop the work and the whole cache, not just those.
            self._in_flight = None
            self.scheduler.abort_all()
            self.block_manager.reset_prefix_cache()
            raise
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        self.num_steps += 1
        if step.prompt_spans:
            self._score_prompts(step.prompt_hidden, step.prompt_spans)
        if step.pooled:
            finished += self._retire_pooled(step.pooled)
        sampling, logits = step.sampling, step.logits
        if overlap:   # read back the step before while this one runs
            if self._in_flight is not None:
                self.num_overlapped_steps += 1
            if any(seq.matcher is not None for seq in sampling):
                # A grammar's mask needs the token before it: read that back while this
                # step's forward runs, then mask and sample.
                finished += self._read_back()
                self._mask_constrained(logits, sampling)
            launched = self._launch_sampling(sampling, logits) if sampling else None
            finished += self._read_back()
            self._in_flight = launched
            return finished
        if not sampling:
            return finished
        if any(seq.num_forks for seq in sampling):
            sampling, logits = self._fork(sampling, logits)
        self._mask_constrained(logits, sampling)
        new_tokens = self.speculator.sample(logits, sampling)   # one each; up to 1 + K with drafts
        now = time.perf_counter()
        for seq, tokens in zip(sampling, new_tokens):
            if seq.first_token_time is None:
                seq.first_token_time = now
            for token in tokens:
                if self._append_token(seq, token):   # stops at the first that ends it
                    seq.finish_time = now
                    self.scheduler.finish(seq)
                    finished.append(_output_of(seq, logprobs=self._logprobs_of(seq),
                                               prompt_logprobs=self._prompt_logprobs_of(seq)))
                    break
            else:
                if seq.draft_token_ids:
                    self.scheduler.discard_rejected(seq)
        return finished

    def _all_overlap(self) -> bool:
        """Whether every running sequence, and every waiting one this step may admit, can
        have its next step launched before its newest token is read (Sequence.overlaps), and
        none forks its other choices this step (n > 1: the forks are made once the prompt's
        token is read; from then on they overlap like any other)."""
        scheduler = self.scheduler
        room = max(0, scheduler.max_num_seqs - len(scheduler.running))
        return (all(seq.overlaps and not seq.num_forks for seq in scheduler.running)
                and all(seq.overlaps and not seq.num_forks for seq in itertools.islice(scheduler.waiting, room)))

    def _launch_sampling(self, sampling: list[Sequence], logits: torch.Tensor) -> StepInFlight:
        """Sample this step's tokens on the device, their places held by PENDING_TOKEN until
        they are read back."""
        previous = self._in_flight.tokens if self._in_flight is not None else None   # penalties count them
        tokens = self.sampler.draw(logits, sampling, previous)
        if any(seq.logprobs is not None for seq in sampling):   # they come back with the tokens
            launched = StepInFlight.launch(sampling, tokens, *self.sampler.with_logprobs(logits, tokens, sampling))
        else:
            launched = StepInFlight.launch(sampling, tokens)
        for row, seq in enumerate(sampling):
            if seq.is_finished:
                continue   # by the step read back before its mask: this row is dropped
            seq.add_pending()
            seq.pending_row = row
        return launched

    def _read_back(self) -> list[RequestOutput]:
        """Wait for the step in flight's tokens, put them in their places and retire the
        sequences they finished."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return []
        tokens = in_flight.token_ids()
        now = time.perf_counter()
        finished = []
        for seq, token in zip(in_flight.sampling, tokens):
            if seq.is_finished:
                continue   # retired while its token was in flight (a timeout, an abort)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if self._resolve_pending(seq, token):
                seq.finish_time = now
                self.block_manager.cache_computed_blocks(seq)
                self.scheduler.finish(seq)
                finished.append(_output_of(seq, logprobs=self._logprobs_of(seq)))
        return finished

    def _resolve_pending(self, seq: Sequence, token: int) -> bool:
        """Put `token` in seq's oldest pending place; returns True when it finishes seq (the
        pending token after it, if the step in flight computes one, is then dropped)."""
        num_output = seq.fill_pending(token)
        if self._ends(seq, token, num_output):
            seq.drop_pending()
            return True
        return False

    def _retire_pooled(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Finish the embedding sequences whose prompt this step completed, with their vectors."""
        vectors = self.runner.pooler.finish(seqs)
        now = time.perf_counter()
        outputs = []
        for seq, vector in zip(seqs, vectors):
            seq.finish_reason = FinishReason.STOP
            seq.first_token_time = seq.finish_time = now
            self.scheduler.finish(seq)
            outputs.append(_output_of(seq, embedding=vector))
        return outputs

    def _fork(self, sampling: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """Fork the other choices of the n > 1 requests whose prompt was just computed. Those
        that run now sample from their first choice's logits row, each drawing its own token;
        returns the sampling sequences and their logits rows, the forks beside their parent."""
        order, rows, row = [], [], 0
        for seq in sampling:
            width = 1 + len(seq.draft_token_ids)
            order.append(seq)
            rows.extend(range(row, row + width))
            if seq.num_forks:   # a prompt just computed: one row, no drafts
                children = [seq.fork(choice, self._detokenizer(seq.prompt_token_ids, seq.params))
                            for choice in range(1, seq.num_forks + 1)]
                seq.num_forks = 0
                for child in children:
                    child.overlaps = seq.overlaps
                if seq.matcher is not None:   # no token consumed yet: a copy is a fresh matcher
                    for child in children:
                        child.matcher = seq.matcher.deep_copy()
                for child in self.scheduler.fork(seq, children):
                    order.append(child)
                    rows.append(row)
            row += width
        return order, logits.index_select(0, torch.tensor(rows, device=logits.device))

    def _score_prompts(self, hidden: torch.Tensor, spans) -> None:
        """Prompt logprobs of this step's prompt positions (their hidden states), on the device:
        each span's flat tensor waits on its sequence until the sampler brings it back with the
        step's one transfer (at the latest in the step that computes the prompt's last token)."""
        targets = [t for seq, first, count in spans for t in seq.prompt_token_ids[first + 1:first + 1 + count]]
        k = max(seq.prompt_logprobs.num_top for seq, _, _ in spans)
        chosen, top_values, top_ids = self.runner.score_prompt_rows(
            hidden, torch.tensor(targets, device=hidden.device), k)
        at = 0
        for seq, first, count in spans:
            scored = seq.prompt_logprobs
            rows, want = slice(at, at + count), scored.num_top
            flat = torch.cat([chosen[rows], top_values[rows, :want].flatten(), top_ids[rows, :want].flatten()])
            scored.pending.append((flat, targets[at:at + count]))
            scored.next_position = first + count
            at += count

    def _mask_constrained(self, logits: torch.Tensor, sampling: list[Sequence]) -> None:
        """Only the grammar's tokens stay possible in the rows of constrained sequences (each
        has one logits row: they are never drafted)."""
        rows, matchers, row = [], [], 0
        for seq in sampling:
            if seq.matcher is not None and not seq.is_finished:   # a finished one's row is dropped
                rows.append(row)
                matchers.append(seq.matcher)
            row += 1 + len(seq.draft_token_ids)
        self.structured.mask(logits, rows, matchers)

    def _logprobs_of(self, seq: Sequence) -> list[dict] | None:
        """seq's logprobs with each token as text and bytes (OpenAI's entries)."""
        if seq.logprobs is None:
            return None
        entry = self._token_entry
        return [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                for token, logprob, top in seq.logprobs[:seq.num_output_tokens]]

    def _prompt_logprobs_of(self, seq: Sequence) -> list[dict] | None:
        """seq's prompt logprobs as entries: the first token's logprob and alternatives are None
        (nothing comes before it), as OpenAI's echo returns them."""
        scored = seq.prompt_logprobs
        if scored is None:
            return None
        entry = self._token_entry
        first = {**entry(seq.prompt_token_ids[0], None), "top_logprobs": None}
        return [first, *({**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                         for token, logprob, top in scored.entries)]

    def _token_entry(self, token_id: int, logprob: float | None) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:   # each token id decoded once per engine (the vocabulary bounds it)
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _retire_timed_out(self) -> list[RequestOutput]:
        """End the sequences that ran past their timeout_s, keeping what they generated."""
        now = time.perf_counter()
        expired = [seq for seq in self.scheduler.unfinished() if seq.is_timed_out(now)]
        for seq in expired:
            seq.drop_pending()   # its tokens in flight
            seq.detokenizer.flush()
            seq.finish_reason, seq.finish_time = FinishReason.TIMEOUT, now
            if seq.matcher is not None:
                seq.valid = False   # cut short by its timeout
            self.scheduler.finish(seq)   # frees its blocks
        # A first choice that timed out before its prompt was computed never forked the others.
        expired += [self._unforked(seq, choice, now) for seq in list(expired) for choice in range(1, seq.num_forks + 1)]
        return [_output_of(seq, error=f"timed out after {seq.timeout_s:g} s", logprobs=self._logprobs_of(seq),
                           prompt_logprobs=self._prompt_logprobs_of(seq)) for seq in expired]

    def _unforked(self, seq: Sequence, choice: int, now: float) -> Sequence:
        child = seq.fork(choice, self._detokenizer(seq.prompt_token_ids, seq.params))
        child.finish_reason, child.finish_time, child.valid = seq.finish_reason, now, seq.valid
        child.status = seq.status
        return child

    def _append_token(self, seq: Sequence, token: int) -> bool:
        """Record a sampled token; returns True when the sequence is finished."""
        output = seq.output_token_ids
        output.append(token)
        return self._ends(seq, token, len(output))

    def _ends(self, seq: Sequence, token: int, num_output: int) -> bool:
        """Take seq's newest output token (its num_output-th, already in place): the grammar
        and the detokenizer see it; returns True when it finishes the sequence."""
        params = seq.params
        matcher = seq.matcher
        if matcher is not None:
            matcher.consume_token(token)   # the mask allowed it; an error shows in is_error()
            if matcher.is_error():
                # llguidance failed on this token (a lexer or parser limit) or in the mask before
                # it (nothing could follow: the mask allowed only end-of-sequence): this request
                # ends as an error (_output_of takes the message from the matcher), its text
                # what the grammar had accepted.
                seq.detokenizer.flush()
                seq.finish_reason, seq.valid = FinishReason.ERROR, False
                return True
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.finish_reason = FinishReason.STOP
        elif seq.detokenizer.add_token(token):
            seq.finish_reason = FinishReason.STOP
            if matcher is not None:
                seq.valid = False   # cut before a stop string
            return True  # the text is already cut before the stop string
        elif matcher is not None and matcher.is_stopped():   # the grammar allows nothing more
            seq.finish_reason = FinishReason.STOP
        elif num_output >= params.max_tokens or len(seq.prompt_token_ids) + num_output >= self.scheduler.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        else:
            return False
        cut = seq.detokenizer.flush()   # held-back text completed a stop string
        if cut:
            seq.finish_reason = FinishReason.STOP
        if matcher is not None:
            seq.valid = not cut and matcher.is_accepting() and not matcher.is_error()
        return True


def _output_of(seq: Sequence, error: str | None = None, logprobs: list[dict] | None = None,
               prompt_logprobs: list[dict] | None = None, embedding: list[float] | None = None) -> RequestOutput:
    if error is None and seq.finish_reason is FinishReason.ERROR and seq.matcher is not None and seq.matcher.is_error():
        error = StructuredOutputs.failure(seq.matcher, seq.detokenizer.text)   # its grammar failed (Engine._ends)
    return RequestOutput(
        id=seq.request_id, text=seq.detokenizer.text, token_ids=list(seq.output_token_ids),
        finish_reason=seq.finish_reason, error=error, prompt_tokens=seq.num_prompt_tokens,
        output_tokens=seq.num_output_tokens, queue_s=seq.first_scheduled_time - seq.arrival_time,
        ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
        latency_s=seq.finish_time - seq.arrival_time, cached_tokens=seq.num_cached_tokens or 0,
        draft_tokens=seq.num_draft_tokens, accepted_tokens=seq.num_accepted_tokens, valid=seq.valid,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, choice=seq.choice, embedding=embedding)


def _error_outputs(request: Request, error: str, prompt_tokens: int, arrival: float) -> list[RequestOutput]:
    latency = time.perf_counter() - arrival
    return [RequestOutput(id=request.id, text="", token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                          prompt_tokens=prompt_tokens, output_tokens=0, queue_s=0.0, ttft_s=None,
                          latency_s=latency, choice=choice)
            for choice in range(request.params.n)]
