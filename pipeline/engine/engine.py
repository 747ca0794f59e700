"""The engine: built from an EngineConfig, it steps: schedule -> run the model -> sample ->
retire (output_processor.py), one step at a time, or each step launched before the one
before it is read back (step_in_flight.py). Requests come in through admission.py.

An embedding request (Request.pooling) goes through the same batches as a prompt that is
never decoded: the step that computes its last prompt token pools its hidden states
(layers/pooler.py) and retires it, its blocks freed (the prefix cache may keep them).

    engine = Engine(EngineConfig(model="path/to/hf-dir"))
    for out in engine.generate(requests):   # each result as soon as it finishes
        ...
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import torch

from pipeline.config import EngineConfig
from pipeline.device import resolve_device, resolve_dtype
from pipeline.engine import clock, memory_budget
from pipeline.engine.admission import Admission
from pipeline.engine.block_manager import BlockManager
from pipeline.engine.choices import fork_choices
from pipeline.engine.generation import generate
from pipeline.engine.model_runner import ModelRunner, StepLogits
from pipeline.engine.output_processor import OutputProcessor, eos_token_ids
from pipeline.engine.scheduler import ScheduledBatch, Scheduler
from pipeline.engine.sequence import Sequence
from pipeline.engine.speculative import Speculator
from pipeline.engine.step_in_flight import StepInFlight, can_overlap
from pipeline.layers.batch_invariant import check_device, make_batch_invariant
from pipeline.layers.grammar_masks import StructuredOutputs
from pipeline.layers.kv_cache import KVCache
from pipeline.layers.packed_linear import pack_linear_layers
from pipeline.layers.quantization.modes import QUANTIZED_LAYERS, linear_quantizer, quantize, quantize_w8a8
from pipeline.layers.quantization.smoothing import calibration_requests
from pipeline.layers.sampler import Sampler
from pipeline.models.loader import load_model, load_tokenizer, read_hf_config, resolve_model_dir
from pipeline.prompts import prompt_token_ids, prompts_token_ids
from pipeline.request import Request, RequestOutput

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        if config.batch_invariant:
            check_device(self.device)
        self.model_dir = resolve_model_dir(config.model)
        self.dtype = dtype = resolve_dtype(config.dtype, self.device, read_hf_config(self.model_dir))
        self.tokenizer = load_tokenizer(self.model_dir)
        # Quantized while loading, one linear at a time, where the mode can (all but none, w8a8).
        quantize_linear = linear_quantizer(config.quantization, self.device, dtype)
        with memory_budget.weights_must_fit(self.device, self.model_dir):
            model, args = load_model(self.model_dir, dtype, self.device, quantize_linear, QUANTIZED_LAYERS)
        self.model = model if quantize_linear else quantize(model, config.quantization, self.device, dtype)
        self.hidden_size = args.hidden_size
        if config.pack_weights and config.quantization == "none":
            pack_linear_layers(self.model)   # CPU float32 and bfloat16; elsewhere it changes nothing

        self.max_num_seqs = memory_budget.max_num_seqs(config, self.device)
        plan = memory_budget.kv_cache_plan(config, self.device, args, dtype, self.max_num_seqs, self.model)
        self.attention_backend = backend = plan.backend
        self.block_size = block_size = plan.block_size
        num_blocks = plan.num_blocks
        kv_cache = KVCache(args.num_layers, args.num_kv_heads, args.head_dim, block_size,
                           num_blocks, plan.kv_dtype, self.device, backend)
        self.block_manager = BlockManager(num_blocks, block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        max_model_len = min(config.max_model_len or args.max_position_embeddings,
                            args.max_position_embeddings)
        log.info(plan.summary(max_model_len))
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
        self.output = OutputProcessor(self.tokenizer, self.scheduler, eos_token_ids(self.model_dir, self.tokenizer))
        self.sampler = Sampler(self.device)
        self.structured = StructuredOutputs(self.tokenizer, args.vocab_size, self.device)
        self.admission = Admission(self.scheduler, self.output, self.structured, self.runner, self.model_dir,
                                   self.hidden_size)
        self.speculator = Speculator(config.speculative, config.num_speculative_tokens, self.sampler)
        overlap = config.overlap_steps if config.overlap_steps is not None else self.device.type == "cuda"
        self.overlap_steps = overlap and config.speculative == "none"   # drafts are proposed from the newest tokens
        self._in_flight: StepInFlight | None = None   # overlapped: the step launched, not read back
        self.num_steps = 0
        self.num_overlapped_steps = 0   # steps launched before the one before them was read back
        if config.quantization == "w8a8":   # smoothed on its float model's ranges, so once the model runs
            quantize_w8a8(self.model, self._calibrate)
        if config.batch_invariant:   # last: it wraps the linear layers that w8a8 calibrated by name
            make_batch_invariant(self.model, backend, dtype, self.device, max_rows=max(
                self.scheduler.max_num_batched_tokens, self.max_num_seqs * (1 + config.num_speculative_tokens)))

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

    def tokenize(self, request: Request) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt=request.prompt, messages=request.messages, tools=request.tools,
                                token_ids=request.prompt_token_ids, reasoning_effort=request.reasoning_effort)

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

    def tokenize_batch(self, requests: list[Request]) -> list[list[int] | Exception]:
        """Each request's prompt ids, or the exception that fails it (prompts_token_ids;
        pipeline.engine.tokenizer_pool makes the same in other processes)."""
        return prompts_token_ids(self.tokenizer, requests)

    def add_requests(self, requests: list[Request], token_ids: list[list[int] | Exception] | None = None
                     ) -> list[list[RequestOutput]]:
        """add_request for each, their prompts tokenized together (tokenize_batch, unless
        token_ids gives its result): each request's error results, [] for those queued."""
        arrival = clock.now()
        if token_ids is None:
            token_ids = self.tokenize_batch(requests)
        return [self.admission.admit(request, ids, arrival, self.overlap_steps)
                for request, ids in zip(requests, token_ids)]

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these unfinished requests and free their blocks (unknown ids are ignored)."""
        self.scheduler.abort(set(request_ids))

    def step(self) -> list[RequestOutput]:
        """One step: retire what timed out, schedule, run the model, sample and retire what
        finished; returns those requests. Overlapped, it launches the step's sampling and
        retires what the step before it finished (step_in_flight.py)."""
        finished = self.output.time_out(clock.now())
        overlap = self.overlap_steps and can_overlap(self.scheduler)
        if not overlap:   # this step needs the tokens in flight on the host
            finished += self._read_back()
        if not self.scheduler.num_unfinished:
            self._in_flight = None   # every sequence in it finished: its rows are dropped
            return finished
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self._in_flight is None:
                raise RuntimeError("scheduler produced an empty step with work pending")
            return finished + self._read_back()   # only sequences whose pending token is their last
        step = self._run(batch)
        if step.pooled:
            finished += self.output.pooled(step.pooled, self.runner.pooler.finish(step.pooled), clock.now())
        sample = self._sample_overlapped if overlap else self._sample
        return finished + sample(step.sampling, step.logits)

    def _run(self, batch: ScheduledBatch) -> StepLogits:
        """The batch's forward; its decode rows whose token is in flight take it on the device."""
        now = clock.now()
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
            self.runner.score_prompts(step.prompt_hidden, step.prompt_spans)
        return step

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample the step's tokens and retire the sequences they finish."""
        if not sampling:
            return []
        if any(seq.num_forks for seq in sampling):
            sampling, logits = fork_choices(sampling, logits, self.scheduler, self.output.detokenizer)
        self._mask_constrained(logits, sampling)
        new_tokens = self.speculator.sample(logits, sampling)   # one each; up to 1 + K with drafts
        now = clock.now()
        finished = (self.output.append(seq, tokens, now) for seq, tokens in zip(sampling, new_tokens))
        return [out for out in finished if out is not None]

    def _sample_overlapped(self, sampling: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """Launch the step's sampling, then read back the step before it (ran meanwhile)."""
        finished = []
        if self._in_flight is not None:
            self.num_overlapped_steps += 1
        if any(seq.matcher is not None for seq in sampling):
            # A grammar's mask needs the token before it: read that back while this
            # step's forward runs, then mask and sample.
            finished += self._read_back()
            self._mask_constrained(logits, sampling)
        launched = StepInFlight.launch(self.sampler, sampling, logits, self._in_flight) if sampling else None
        finished += self._read_back()
        self._in_flight = launched
        return finished

    def _read_back(self) -> list[RequestOutput]:
        in_flight, self._in_flight = self._in_flight, None
        return [] if in_flight is None else in_flight.read_back(self.output)

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
