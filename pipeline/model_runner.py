"""Turns a scheduled batch into one forward pass over packed tokens.

Owns the model and the KV cache: lays out the step's tokens (decodes first, then
prefill chunks), builds the attention metadata shared by every layer, and returns
logits only for the sequences that sample this step.

A decoding sequence with draft tokens (speculative.py) runs its last token and its K
drafts as 1 + K decode rows over its own blocks, row i attending to the context up to
itself: the same decode attention as any other decode, since every token's keys and
values are written before attention reads them. It gets logits for all 1 + K rows.
"""
from __future__ import annotations

import torch

from pipeline.attention import AttentionMetadata, DecodeLayout, PrefillChunk, cache_rows
from pipeline.kv_cache import KVCache
from pipeline.scheduler import ScheduledBatch
from pipeline.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache = kv_cache.k[i]
            layer.self_attn.v_cache = kv_cache.v[i]
            if kv_cache.k_scale is not None:
                layer.self_attn.k_scale = kv_cache.k_scale[i]
                layer.self_attn.v_scale = kv_cache.v_scale[i]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Run one step. Returns the sequences whose last token was computed (they sample
        now) and their logits [rows, vocab]: one row each, 1 + len(draft_token_ids) for a
        sequence with drafts, in the order of the returned sequences."""
        order = sorted(range(len(batch.seqs)),
                       key=lambda i: not (batch.num_new_tokens[i] == 1 or batch.seqs[i].draft_token_ids))
        seqs = [batch.seqs[i] for i in order]
        num_new = [batch.num_new_tokens[i] for i in order]
        input_ids, positions, meta, sample_rows = self._prepare(seqs, num_new)
        hidden = self.model(input_ids, positions, meta)                 # [tokens, hidden]
        sampling = [s for s, n in zip(seqs, num_new) if s.num_computed_tokens + n >= s.num_tokens]
        if not sampling:
            return [], hidden.new_empty((0, 0))
        logits = self.model.compute_logits(hidden[sample_rows])         # [sampling, vocab]
        return sampling, logits

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, seqs: list[Sequence], num_new: list[int]):
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        for seq, n in zip(seqs, num_new):
            start = seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(seq.token_ids(start, min(start + n, seq.num_tokens)))
            input_ids.extend(seq.draft_token_ids)   # scheduled only with the last real token
            positions.extend(range(start, start + n))
            slot_mapping.extend(self._slots(seq.block_table, start, start + n))
            if seq.draft_token_ids:
                sample_rows.extend(range(row, row + n))
                decode_tables.extend([seq.block_table] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
                continue
            if start + n == seq.num_tokens:
                sample_rows.append(row + n - 1)
            if n == 1:
                decode_tables.append(seq.block_table)
                decode_lens.append(start + 1)
            elif start == 0:
                prefills.append(PrefillChunk(row, row + n, None, None))
            else:
                num_blocks = -(-(start + n) // self.block_size)
                block_ids = torch.tensor(seq.block_table[:num_blocks], device=self.device)
                q_pos = torch.arange(start, start + n, device=self.device).unsqueeze(1)
                mask = torch.arange(start + n, device=self.device).unsqueeze(0) <= q_pos
                prefills.append(PrefillChunk(row, row + n, block_ids, mask))

        meta = AttentionMetadata(
            cache_rows=cache_rows(torch.tensor(slot_mapping, device=self.device), self.kv_cache.k.shape[2],
                                  self.block_size),
            decode=(DecodeLayout.build(decode_tables, decode_lens, self.block_size, self.device)
                    if decode_tables else None),
            prefills=prefills)
        return (torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                meta, torch.tensor(sample_rows, device=self.device))
