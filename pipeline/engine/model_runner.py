"""Turns a scheduled batch into one forward pass over packed tokens.

Owns the model, the KV cache and the attention backend: lays out the step's tokens
(decodes first, then prefill chunks) once on the host with numpy (`StepLayout`), has the
backend build its metadata from that (shared by every layer), and returns logits only
for the sequences that sample this step. On CUDA every array reaches the device through
a persistent pinned buffer with a non-blocking copy, and nothing is read back during the
forward: the step's only sync is the sampled tokens.

A decoding sequence with draft tokens (speculative.py) runs its last token and its K
drafts as 1 + K rows over its own blocks, row i attending to the context up to itself
(each row one decode for the cpu backend, one query of 1 + K rows for the varlen ones):
every token's keys and values are written before attention reads them. It gets logits
for all 1 + K rows.

A sequence asking for prompt logprobs also gets the hidden states of its prompt chunk's
rows (prompt_hidden), which `score_prompts` turns into logprobs a few rows' logits at a
time. An embedding sequence (Sequence.pooling) never samples: the pooler takes its
hidden states, and the step names those whose prompt is now complete (`pooled`).

Decode-only steps on CUDA replay a captured CUDA graph when the backend allows it
(cuda_graphs.py); every other step runs eagerly.

Overlapped steps (step_in_flight.py): a decoding sequence whose newest token the previous step
sampled and the host has not read back holds PENDING_TOKEN there; `run` takes that step's
sampled tokens, still on the device, and fills those input rows from them before the forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.layers.attention import AttentionBackend, HostToDevice, StepLayout
from pipeline.layers.kv_cache import KVCache
from pipeline.layers.sampler import token_logprobs
from pipeline.engine.scheduler import ScheduledBatch
from pipeline.engine.sequence import Sequence

# Prompt logprobs take the logits of this many bytes of rows at a time on a CPU. A whole
# chunk's [1024, 49,152] float32 logits and their log-softmax are 200 MB each, which glibc
# maps afresh and page-faults in every step; pieces of a few MB its heap serves again. A
# prompt-scoring job (W1's 64 prompts, logprobs of every prompt token) ran 1.15x faster and
# peaked 330 MB lower. CUDA's caching allocator keeps its blocks: there the rows go whole.
CPU_LOGITS_CHUNK_BYTES = 16 << 20


@dataclass(slots=True)
class PendingInputs:
    """Input rows whose token the previous step sampled and the host has not read back."""
    rows: torch.Tensor      # [k] rows of this step's input ids
    sources: torch.Tensor   # [k] their rows in `tokens`
    tokens: torch.Tensor    # the previous step's sampled tokens, on the device

    def fill(self, input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.rows, self.tokens.index_select(0, self.sources))


@dataclass(slots=True)
class StepLogits:
    """What a step's forward gives the engine."""
    sampling: list[Sequence]   # the sequences whose last token was computed: they sample now
    logits: torch.Tensor       # [rows, vocab]: one row each, 1 + len(draft_token_ids) with drafts, in order
    prompt_hidden: torch.Tensor | None = None   # [positions, hidden]: prompt positions scoring the next token
    prompt_spans: tuple = ()   # (seq, first position, count) for each sequence in prompt_hidden, in order
    pooled: list = ()          # embedding sequences whose prompt is complete: Sequence.pooled holds the vector


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, device: torch.device, backend: AttentionBackend | None = None):
        if backend is None:
            from pipeline.layers.attention.cpu import CpuBackend
            backend = CpuBackend()
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.backend = backend
        self.block_size = kv_cache.block_size
        self.to_device = HostToDevice(device)
        self.graphs = None   # cuda_graphs.DecodeGraphs, once captured (Engine)
        self.pooler = None   # layers.pooler.Pooler, once an embedding request comes (Engine)
        self.table_rows = None   # the block manager's BlockTableRows (Engine); else tables from the lists
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.backend = backend
            layer.self_attn.cache = kv_cache.layer(i)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination), every layer: copy on write for forked
        choices (block_manager), before the step's forward writes any of them."""
        if copies:
            self.kv_cache.copy_blocks(copies)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, previous_tokens: torch.Tensor | None = None) -> StepLogits:
        """Run one step: the logits of the sequences that sample now, and of the prompt
        positions whose logprobs are asked for (Sequence.wants_prompt_logits).
        previous_tokens: the tokens the step in flight sampled, on the device, which its
        sequences' pending rows take (overlapped steps)."""
        seqs, num_new = batch.seqs, batch.num_new_tokens
        if max(num_new) > 1:   # decodes first (a plain decode step is in order already)
            order = sorted(range(len(seqs)), key=lambda i: not (num_new[i] == 1 or seqs[i].draft_token_ids))
            seqs, num_new = [seqs[i] for i in order], [num_new[i] for i in order]
        layout = self._prepare(seqs, num_new)
        pending = self._pending_inputs(seqs, num_new, previous_tokens)
        sampling = [s for s, n in zip(seqs, num_new) if s.num_computed_tokens + n >= s.num_tokens and s.pooling is None]
        prompt_rows, spans = _prompt_rows(seqs, num_new)
        if (self.graphs is not None and layout.is_plain_decode and len(sampling) == layout.num_seqs
                and not spans and self.graphs.serves(layout.num_seqs)):
            hidden = self.graphs.replay(layout, self.to_device, pending)   # every row samples
            return StepLogits(sampling, self.model.compute_logits(hidden))
        hidden = self.forward(layout, pending)                             # [tokens, hidden]
        pooled = self.pooler.collect(hidden, seqs, num_new) if self.pooler is not None else []
        prompt_hidden = hidden[self.to_device("prompt_rows", prompt_rows)] if spans else None
        if not sampling:
            return StepLogits([], hidden.new_empty((0, 0)), prompt_hidden, spans, pooled)
        sample_rows = self.to_device("sample_rows", layout.sample_rows)
        return StepLogits(sampling, self.model.compute_logits(hidden[sample_rows]), prompt_hidden, spans, pooled)

    @torch.inference_mode()
    def score_prompts(self, hidden: torch.Tensor, spans) -> None:
        """Prompt logprobs of a step's prompt positions (their hidden states), on the device:
        each span's flat tensor waits on its sequence until the sampler brings it back with the
        step's one transfer (at the latest in the step that computes the prompt's last token)."""
        targets = [t for seq, first, count in spans for t in seq.prompt_token_ids[first + 1:first + 1 + count]]
        k = max(seq.prompt_logprobs.num_top for seq, _, _ in spans)
        chosen, top_values, top_ids = self.score_prompt_rows(hidden, torch.tensor(targets, device=hidden.device), k)
        at = 0
        for seq, first, count in spans:
            scored = seq.prompt_logprobs
            rows, want = slice(at, at + count), scored.num_top
            flat = torch.cat([chosen[rows], top_values[rows, :want].flatten(), top_ids[rows, :want].flatten()])
            scored.pending.append((flat, targets[at:at + count]))
            scored.next_position = first + count
            at += count

    def score_prompt_rows(self, hidden: torch.Tensor, targets: torch.Tensor, k: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_logprobs of prompt rows (hidden [rows, hidden], the token each scores
        [rows]), their logits taken a chunk of rows at a time on a CPU (CPU_LOGITS_CHUNK_BYTES)."""
        rows = len(hidden)
        if self.device.type == "cpu":
            rows = max(1, CPU_LOGITS_CHUNK_BYTES // (4 * self.model.args.vocab_size))
        parts = [token_logprobs(self.model.compute_logits(hidden[i:i + rows]), targets[i:i + rows], k)
                 for i in range(0, len(hidden), rows)]
        return tuple(torch.cat(columns) for columns in zip(*parts))

    def forward(self, layout: StepLayout, pending: PendingInputs | None = None) -> torch.Tensor:
        """The eager forward of a step: hidden states [tokens, hidden]."""
        meta = self.backend.build_metadata(layout, self.kv_cache.num_kv_heads, self.to_device)
        input_ids = self.to_device("input_ids", layout.input_ids)
        if pending is not None:
            pending.fill(input_ids)
        return self.model(input_ids, self.to_device("positions", layout.positions), meta)

    def _pending_inputs(self, seqs: list[Sequence], num_new: list[int],
                        previous_tokens: torch.Tensor | None) -> PendingInputs | None:
        """The input rows of the sequences whose newest token is pending (each decodes just
        that token)."""
        rows, sources, row = [], [], 0
        for seq, n in zip(seqs, num_new):
            if seq.num_pending_tokens:
                if n != 1 or previous_tokens is None:
                    raise RuntimeError(f"sequence {seq.request_id!r}: a pending token must be the one input of a "
                                       f"decode after the step that sampled it")
                rows.append(row)
                sources.append(seq.pending_row)
            row += n
        if not rows:
            return None
        return PendingInputs(self.to_device("pending_rows", np.asarray(rows, dtype=np.int64)),
                             self.to_device("pending_sources", np.asarray(sources, dtype=np.int64)),
                             previous_tokens)

    def _prepare(self, seqs: list[Sequence], num_new: list[int]) -> StepLayout:
        # Per sequence only what numpy cannot do: a decode step at 256 sequences spends
        # its host time in loops like this one (benchmarks/host_step.py --stub-model).
        bs = self.block_size
        input_ids: list[int] = []
        starts, rows, sample_rows = [], [], []
        num_decode = 0
        for seq, n in zip(seqs, num_new):
            start, num_tokens, drafts = seq.num_computed_tokens, seq.num_tokens, seq.draft_token_ids
            if drafts or n == 1:
                num_decode += 1
            if start + n >= num_tokens and seq.pooling is None:
                if drafts:
                    sample_rows.extend(range(len(input_ids), len(input_ids) + n))
                else:
                    sample_rows.append(len(input_ids) + n - 1)
            if n == 1 and not drafts:   # a decode: its one token
                input_ids.append(seq.token_id(start))
            else:
                input_ids.extend(seq.token_ids(start, min(start + n, num_tokens)))
                input_ids.extend(drafts)   # scheduled only with the last real token
            starts.append(start)
            rows.append(seq.table_row)
        num_seqs = len(seqs)
        query_lens = np.array(num_new, dtype=np.int32)
        context_lens = np.array(starts, dtype=np.int32) + query_lens
        # Block tables, padded with the pad block: only the blocks each sequence reaches this step.
        used = -(-context_lens // bs)
        if self.table_rows is not None and None not in rows:
            block_tables = self.table_rows.gather(rows, used, self.kv_cache.pad_block)
        else:   # sequences whose tables no block manager keeps (made by hand)
            block_tables = np.full((num_seqs, int(used.max())), self.kv_cache.pad_block, dtype=np.int32)
            for row, (seq, n_blocks) in enumerate(zip(seqs, used.tolist())):
                block_tables[row, :n_blocks] = seq.block_table[:n_blocks]
        # Every token's position and cache slot, from its sequence's row.
        tokens = len(input_ids)
        owner = np.repeat(np.arange(num_seqs), query_lens)
        first_row = np.cumsum(query_lens) - query_lens
        positions = (np.arange(tokens) - np.repeat(first_row - (context_lens - query_lens), query_lens)).astype(np.int64)
        slot_mapping = block_tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        return StepLayout(input_ids=np.array(input_ids, dtype=np.int64), positions=positions,
                          slot_mapping=slot_mapping, query_lens=query_lens, context_lens=context_lens,
                          block_tables=block_tables, num_decode_seqs=num_decode,
                          sample_rows=np.array(sample_rows, dtype=np.int64), block_size=bs,
                          pad_block=self.kv_cache.pad_block)


def _prompt_rows(seqs: list[Sequence], num_new: list[int]) -> tuple[np.ndarray, tuple]:
    """The packed rows of the prompt positions whose logits are wanted this step, and the
    (seq, first position, count) span of each sequence among them. Position p's logits score
    prompt token p + 1, so a prompt of P tokens wants positions 0 .. P - 2, once each."""
    rows, spans, base = [], [], 0
    for seq, n in zip(seqs, num_new):
        if seq.wants_prompt_logits:
            start = seq.num_computed_tokens
            first = max(start, seq.prompt_logprobs.next_position)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last > first:
                rows.extend(range(base + first - start, base + last - start))
                spans.append((seq, first, last - first))
        base += n
    return np.asarray(rows, dtype=np.int64), tuple(spans)
