"""CUDA graphs for decode-only steps, at bucketed batch sizes.

A step where every sequence decodes one token (no prefill, no drafts) is shape-stable
but for its batch size b, and at small b launching a forward's hundreds of kernels costs
more than running them. So the forward is captured once per bucket (1, 2, 4, 8, then
every 16 up to max_num_seqs), over static buffers: input ids, positions, and the varlen
metadata (slot mapping, seqused_k, cumulative lengths, block table) with max_q = 1 and
max_k = max_model_len. A step of b sequences fills the first b rows of those buffers and
replays the graph of the smallest bucket >= b; the padding rows are one-token sequences
on the reserved pad block (KVCache.pad_block), which no sequence ever owns, so what they
write is never read by a real row. Mixed steps and steps with drafts run eagerly, and so
does every step where capture fails (capture_decode_graphs logs it).

The forward captured is `forward(bucket)`; on a CPU the same function is what a test
compiles with torch.compile(fullgraph=True) to prove it has no graph break (nothing read
back to the host, nothing that would fall out of a capture).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from pipeline.layers.attention import HostToDevice, StepLayout
from pipeline.layers.attention.varlen import VarlenMetadata


log = logging.getLogger(__name__)


def capture_decode_graphs(model, max_num_seqs: int, max_model_len: int, block_size: int, pad_block: int,
                          device: torch.device) -> "DecodeGraphs | None":
    """The captured graphs, or None when this torch or GPU cannot capture them: every step
    then runs eagerly (correct, slower), and the log says so."""
    graphs = DecodeGraphs(model, max_num_seqs, max_model_len, block_size, pad_block, device)
    try:
        graphs.capture()
    except RuntimeError as e:
        log.warning("CUDA graphs could not be captured, every step runs eagerly (slower): %s",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        graphs.graphs.clear()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return None
    return graphs


def buckets(max_num_seqs: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int, pad_block: int,
                 device: torch.device):
        self.model = model
        self.buckets = buckets(max_num_seqs)
        self.max_pages = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.block_size, self.pad_block = block_size, pad_block
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), pad_block * block_size, dtype=torch.int64, device=device)
        self.cu_seq_q = torch.arange(n + 1, dtype=torch.int32, device=device)   # one row per sequence, always
        self.cu_seq_k = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seqused_k = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.full((n, self.max_pages), pad_block, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, model.args.hidden_size, dtype=model.model.embed_tokens.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def serves(self, num_seqs: int) -> bool:
        return self.bucket(num_seqs) in self.graphs

    def metadata(self, bucket: int) -> VarlenMetadata:
        return VarlenMetadata(slot_mapping=self.slot_mapping[:bucket], cu_seq_q=self.cu_seq_q[:bucket + 1],
                              cu_seq_k=self.cu_seq_k[:bucket + 1], seqused_k=self.seqused_k[:bucket],
                              block_table=self.block_table[:bucket], max_q=1, max_k=self.max_model_len)

    def forward(self, bucket: int) -> torch.Tensor:
        """The padded decode forward over the static buffers: hidden states [bucket, hidden]."""
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.metadata(bucket))

    def load(self, layout: StepLayout, to_device: HostToDevice) -> int:
        """Fill the static buffers with a plain decode step, padded to its bucket; returns the bucket."""
        b, bucket = layout.num_seqs, self.bucket(layout.num_seqs)
        pad = bucket - b
        ids = np.concatenate([layout.input_ids, np.zeros(pad, dtype=np.int64)])
        positions = np.concatenate([layout.positions, np.zeros(pad, dtype=np.int64)])
        slots = np.concatenate([layout.slot_mapping, np.full(pad, self.pad_block * self.block_size, dtype=np.int64)])
        seqused = np.concatenate([layout.context_lens, np.ones(pad, dtype=np.int32)]).astype(np.int32)
        cu_k = np.zeros(bucket + 1, dtype=np.int32)
        np.cumsum(seqused, out=cu_k[1:])
        table = np.full((bucket, self.max_pages), self.pad_block, dtype=np.int32)
        table[:b, :layout.block_tables.shape[1]] = layout.block_tables
        for name, dst, array in (("graph_ids", self.input_ids, ids), ("graph_positions", self.positions, positions),
                                 ("graph_slots", self.slot_mapping, slots), ("graph_seqused", self.seqused_k, seqused),
                                 ("graph_cu_k", self.cu_seq_k, cu_k), ("graph_table", self.block_table, table)):
            to_device.copy_into(name, dst[:len(array)], array)
        return bucket

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool (as nano-vllm does).
        The static buffers hold pad rows meanwhile, so warm-up and capture write only the pad block."""
        pool = None
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            self.hidden[:bucket] = self.forward(bucket)    # warm-up: lazy inits, cuBLAS workspaces
            with torch.cuda.graph(graph, pool):
                self.hidden[:bucket] = self.forward(bucket)
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
            torch.cuda.synchronize()

    def replay(self, layout: StepLayout, to_device: HostToDevice, pending=None) -> torch.Tensor:
        """Hidden states [b, hidden] of a plain decode step of b sequences; pending (a
        model_runner.PendingInputs) fills the rows whose token is still on the device."""
        bucket = self.load(layout, to_device)
        if pending is not None:
            pending.fill(self.input_ids)
        self.graphs[bucket].replay()
        return self.hidden[:layout.num_seqs]
