"""Hands out fixed-size KV-cache blocks to sequences, takes them back, and remembers
what full blocks hold so that a prompt prefix is never computed twice (prefix caching).

Torch-free bookkeeping over the pool that `kv_cache.KVCache` preallocates: a block id
is an index into that pool; nothing is ever reallocated.

Prefix caching: a full block that is (or, by the end of the current step, will be)
computed gets a hash chained from its parent block's hash and its own token ids, so
equal hashes mean an equal token prefix up to and including the block. A block's keys
and values depend on nothing else: the cache belongs to one engine (one model, dtype and
set of weights), and the position is fixed by the chain. Blocks are reference-counted;
only full blocks are shared, and a sequence's tokens after its last shared block go into
fresh blocks, so a shared block is never written. When its last holder lets go, a
hashed block is not wiped: it waits, findable, in an LRU list of free cached blocks and
is reused for other content only when no plain free block is left.

Forking (a request's n > 1 choices): the choices share every block of the computed
prompt, the partial last one included. A sequence about to write into a block that
others still hold gets a private copy first (copy on write): `try_allocate` swaps in a
fresh block and queues the copy, which the engine makes before the step's forward.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from pipeline.engine.block_table_rows import BlockTableRows
from pipeline.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None   # set while the block's content is findable in the cache


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block, chained from its parent's. A cryptographic hash (not Python's
    64-bit hash()) so that one job's prompt cannot be crafted to collide with another's."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))   # unused, nothing cached
        # Unused but still holding cached content, least recently used first.
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()
        self.cached_block_ids: dict[bytes, int] = {}                  # hash -> block id
        self.peak_used_blocks = 0   # most blocks held by sequences at once (reset_peak())
        self.pending_copies: list[tuple[int, int]] = []   # (source, destination) block ids, copy on write
        self.table_rows = BlockTableRows()   # every holder's block table as an array row, for the model runner

    # ---- state ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: plain free ones plus unused cached ones."""
        return len(self.free_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is findable in the prefix cache (in use or not)."""
        return len(self.cached_block_ids)

    @property
    def utilization(self) -> float:
        """Fraction of the pool held by sequences (cached but unused blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def peak_utilization(self) -> float:
        """The highest `utilization` since the pool was made or reset_peak() was called."""
        return self.peak_used_blocks / self.num_blocks

    def reset_peak(self) -> None:
        self.peak_used_blocks = self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of seq's first `num_blocks` full blocks. A sequence's tokens only ever
        grow, so the hashes are kept on it and extended as more blocks fill."""
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(block_hash(hashes[-1] if hashes else None, seq.token_ids(i * bs, (i + 1) * bs)))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Ids of the cached blocks that hold the longest prefix of seq's tokens, leaving
        at least its last token to compute (its logits are needed to sample). Takes no
        reference: pass the result to `try_allocate`."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for i in range(max_blocks):
            # Hashing block by block stops at the first miss without hashing the rest.
            block_id = self.cached_block_ids.get(self.block_hashes(seq, i + 1)[i])
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no sequence holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in self.cached_free_block_ids:
            self.blocks[block_id].hash = None
            self.free_block_ids.append(block_id)
        self.cached_free_block_ids.clear()
        self.cached_block_ids.clear()
        return True

    # ---- allocation -------------------------------------------------------------------

    def try_allocate(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Make seq hold `num_tokens` tokens: first the cached blocks found by
        `find_cached_prefix` (seq must hold no block yet), then fresh blocks. Returns False,
        changing nothing, when the pool is short: the caller's signal to preempt or wait.

        Every full block among those `num_tokens` is computed by the end of this step, so
        it becomes findable now. A sequence admitted later in the same step can share it:
        within each layer every new token's keys and values are written to the cache
        before any attention reads it (models/llama.py), so requests that arrive together
        compute a shared prefix once."""
        bs = self.block_size
        shared = self._shared_write_block(seq)
        # Most decodes write into a block the sequence already holds alone: nothing to take.
        if cached_block_ids or num_tokens > len(seq.block_table) * bs or shared is not None:
            needed = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_block_ids)
            if not self._take_blocks(seq, needed, cached_block_ids, shared):
                return False
        # Slots past seq.num_tokens hold draft tokens (speculative decoding), not yet the
        # sequence's, and a pending token's id is not known yet (overlapped steps): a block
        # is findable only once the host knows it full of real tokens. (The first test is
        # the cheap bound: true once in block_size decodes.)
        if self.enable_prefix_caching and num_tokens // bs > seq.num_registered_blocks:
            num_full = min(num_tokens, seq.num_known_tokens) // bs
            if num_full > seq.num_registered_blocks:
                self._cache_full_blocks(seq, num_full)
        return True

    def _take_blocks(self, seq: Sequence, needed: int, cached_block_ids: list[int], shared: int | None) -> bool:
        """try_allocate's taking: the cached blocks, `needed` fresh ones and the copy of the
        shared block about to be written; False, changing nothing, when the pool is short."""
        reused_free = sum(b in self.cached_free_block_ids for b in cached_block_ids)
        if needed + (shared is not None) > self.num_free_blocks - reused_free:
            return False
        changed = len(seq.block_table) if shared is None else shared   # the first entry to mirror
        if shared is not None:   # copy on write: the others keep the original
            source = seq.block_table[shared]
            self.blocks[source].ref_count -= 1
            seq.block_table[shared] = self._take_free_block()
            self.pending_copies.append((source, seq.block_table[shared]))
        for block_id in cached_block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.cached_free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        self.table_rows.write(seq, changed)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_blocks - self.num_free_blocks)
        return True

    def share(self, parent: Sequence, child: Sequence) -> None:
        """Make child (a fork holding no block) hold every block of parent, as it stands."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        self.table_rows.write(child)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies on write queued since the last call: (source, destination) block ids."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in seq's block table of the partly filled block its next token goes into,
        when other sequences hold it too (forked choices); else None. Full shared blocks
        are never written: writing starts past them."""
        start = seq.num_computed_tokens
        index = start // self.block_size
        if start % self.block_size and index < len(seq.block_table):
            if self.blocks[seq.block_table[index]].ref_count > 1:
                return index
        return None

    def free(self, seq: Sequence) -> None:
        """Let go of seq's blocks (finished, cancelled or preempted)."""
        # Tail first: the least recently used cached blocks are evicted first, and a
        # chain's later blocks are the ones least likely to be shared again.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free_block_ids[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table.clear()
        self.table_rows.release(seq)
        seq.num_registered_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Let go of seq's blocks past the first `num_tokens` tokens (the slots of rejected
        draft tokens). Such tail blocks were never full of real tokens, so never findable."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached_free_block_ids[block.block_id] = None
                else:
                    self.free_block_ids.appendleft(block.block_id)   # most likely taken again next step
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:   # evict the least recently used cached block
            block_id, _ = self.cached_free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            del self.cached_block_ids[block.hash]
            block.hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Make findable the full blocks of seq's computed tokens whose ids the host now knows:
        overlapped steps compute a token before its id comes back (try_allocate leaves its
        block for the next step, which a sequence that finishes never has). Not for drafted
        sequences: a rejected draft's slot is computed but holds another token."""
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size)

    def _cache_full_blocks(self, seq: Sequence, num_full_blocks: int) -> None:
        """Make seq's blocks [seq.num_registered_blocks, num_full_blocks) findable."""
        if num_full_blocks <= seq.num_registered_blocks:
            return
        hashes = self.block_hashes(seq, num_full_blocks)
        for i in range(seq.num_registered_blocks, num_full_blocks):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and hashes[i] not in self.cached_block_ids:
                block.hash = hashes[i]
                self.cached_block_ids[hashes[i]] = block.block_id
            # else: shared from the cache already, or the same content was computed twice
            # (both in one step before either was findable); the first copy stays the one found.
        seq.num_registered_blocks = num_full_blocks
