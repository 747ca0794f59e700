"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seeds.

One batched step with one host transfer: every row's token is chosen on the device and
the whole batch's tokens come back in a single `.tolist()` (the only host sync of a step;
tests/layers/test_sampler.py counts them). A random row draws by inverse CDF: one uniform
number per row, found in the row's running sum of p. (The exponential race,
argmax(p / E) with E ~ Exp(1), needs a random number per vocabulary entry: 42 ms a step for
30 rows of a 49,152-token vocabulary on a CPU, against 1 ms for this.) The running sum is
taken in two levels, float32 sums of 1,024-token blocks and then float64 within the one
block a row lands in, so no float64 copy of the whole [rows, vocab] is made (at 256 rows
that copy and its sum took 52 ms; the block sums take 3.5). Unseeded rows take
their numbers from the sampler's generator in one call; a row with a seed takes its number
from its own torch.Generator, so a seeded request gives the same text whatever else shares
its batch. Which filters run is decided from the parameters on the host, never by reading
a device tensor back. Overlapped steps (engine/step_in_flight.py) call its two halves apart: `draw` (the
tokens, left on the device) and `with_logprobs` (the flat tensor to bring back, and its
unpack), and bring the values back one step later.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.layers import top_tokens

if TYPE_CHECKING:   # the sampler reads sequences' settings; layers sit below the engine
    from pipeline.engine.sequence import Sequence

CDF_BLOCK = 1024   # tokens a block of the inverse CDF's first level


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None):
        self.device = device
        # Unseeded requests share one generator.
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()  # non-deterministic; torch.seed() would reseed the global RNG
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] float32 -> one token id per sequence."""
        tokens = self.draw(logits, seqs)
        # Prompt logprobs computed in this or earlier steps (ModelRunner.score_prompts), once per
        # request (the forks of an n > 1 request share them).
        prompts = list({id(s.prompt_logprobs): s.prompt_logprobs for s in seqs
                        if s.prompt_logprobs is not None and s.prompt_logprobs.pending}.values())
        if prompts or any(s.logprobs is not None for s in seqs):
            values, unpack = self.with_logprobs(logits, tokens, seqs, prompts)
            return unpack(values.tolist())   # the step's one host transfer
        return tokens.tolist()   # the step's one host transfer

    @torch.inference_mode()  # the logits are inference tensors; the penalty edits them in place
    def draw(self, logits: torch.Tensor, seqs: list[Sequence],
             previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [len(seqs), vocab] float32 -> one token id per sequence, on the device
        (nothing read back: overlapped steps feed them to the next forward as they are).
        previous_tokens: the step in flight's tokens, where pending ones are penalised."""
        self._apply_penalties(logits, seqs, previous_tokens)
        sampled = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        tokens = top_tokens.argmax(logits) if len(sampled) < len(seqs) else None
        if sampled:
            rows = [seqs[i] for i in sampled]
            probs = self._filtered_probs(logits[sampled] if tokens is not None else logits,
                                         [s.params for s in rows], normalize=False)
            drawn = self._inverse_cdf(probs, rows)
            if tokens is None:
                tokens = drawn
            else:
                tokens[self._to_device(np.asarray(sampled, dtype=np.int64))] = drawn
        return tokens

    @torch.inference_mode()
    def with_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence],
                      prompts: list = ()) -> tuple[torch.Tensor, Callable[[list[float]], list[int]]]:
        """The tokens, each asking row's logprobs and the prompt logprobs waiting on the device,
        as one flat float64 tensor for one transfer (ids exact below 2**53), and what turns
        its values on the host into the token ids, appending each row's logprobs to its
        sequence (overlapped steps unpack a step late; a finished sequence's results were
        taken before, with its logprobs cut to its tokens)."""
        rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        k = max((seqs[i].params.logprobs for i in rows), default=0)
        parts = [tokens.double()]
        if rows:
            if len(rows) == len(seqs):   # every row asks (a job that wants logprobs usually does)
                asking, chosen_tokens = logits, tokens
            else:
                index = self._to_device(np.asarray(rows, dtype=np.int64))
                asking, chosen_tokens = logits.index_select(0, index), tokens.index_select(0, index)
            chosen, values, ids = token_logprobs(asking, chosen_tokens, k)
            parts += [chosen, values.flatten(), ids.flatten()]
        parts += [flat for scored in prompts for flat, _ in scored.pending]

        def unpack(values: list[float]) -> list[int]:
            n, m = len(seqs), len(rows)
            token_ids = [int(t) for t in values[:n]]
            top_values, top_ids = values[n + m:n + m + m * k], values[n + m + m * k:n + m + 2 * m * k]
            for j, i in enumerate(rows):
                want = seqs[i].params.logprobs
                alternatives = [(int(top_ids[j * k + r]), top_values[j * k + r]) for r in range(want)]
                seqs[i].logprobs.append((token_ids[i], values[n + j], alternatives))
            at = n + m + 2 * m * k
            for scored in prompts:
                at = _unpack_prompt_logprobs(scored, values, at)
            return token_ids

        return torch.cat(parts), unpack

    def _inverse_cdf(self, weights: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row drawn from weights [rows, vocab] (probabilities up to a factor):
        the first whose running sum reaches u * total, u in (0, 1]. First the block whose
        running total of block sums reaches it, then the token within that block whose float64
        running sum reaches the rest. u > 0 and "reaches" (>=) skip tokens of weight 0 (their
        running sum equals the one before); where a block's float32 sum and its float64
        running sum round apart, the draw stays on the block's last token of weight > 0."""
        rows, vocab = weights.shape
        width = min(CDF_BLOCK, vocab)
        full = vocab // width * width
        sums = weights[:, :full].unflatten(1, (-1, width)).sum(-1)
        if full < vocab:
            sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)
        block_cdf = sums.double().cumsum_(dim=1)                                   # [rows, blocks]
        target = ((1.0 - self._uniforms(seqs, weights.device)) * block_cdf[:, -1]).unsqueeze(1)
        block = torch.searchsorted(block_cdf, target)                              # [rows, 1]
        before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
        columns = block * width + torch.arange(width, device=weights.device)      # [rows, width]
        inside = weights.gather(1, columns.clamp_max(vocab - 1)).masked_fill_(columns >= vocab, 0.0)
        index = torch.searchsorted(inside.double().cumsum_(dim=1), target - before)
        last = width - 1 - (inside > 0).flip(1).int().argmax(dim=1, keepdim=True)
        return (block * width + torch.minimum(index, last)).squeeze(1)

    def _uniforms(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """U[0, 1) float64 [rows]: seeded rows from their own generator, the rest in one draw."""
        seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
        if not seeded:
            return torch.rand(len(seqs), generator=self.generator, device=device, dtype=torch.float64)
        u = torch.empty(len(seqs), device=device, dtype=torch.float64)
        if len(seeded) < len(seqs):
            unseeded = self._to_device(np.asarray([i for i, s in enumerate(seqs) if s.params.seed is None],
                                                  dtype=np.int64))
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, device=device, dtype=torch.float64)
        for i in seeded:
            u[i:i + 1] = torch.rand(1, generator=self._generator_of(seqs[i]), device=device, dtype=torch.float64)
        return u

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The generator seq's random numbers come from: its own when seeded, else the shared one."""
        return self.generator if seq.params.seed is None else self._generator_of(seq)

    def _generator_of(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seq.seed)   # each choice of an n > 1 request its own
        return seq.generator

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence],
                         previous_tokens: torch.Tensor | None = None) -> None:
        """Every penalised row at once, from (row, token) pairs built on the host (no loop over
        the vocabulary): first the CTRL-style repetition penalty (a seen token's logit divided
        if > 0, else multiplied), then OpenAI's additive ones over the output so far
        (frequency * count + presence), and the logit bias.

        A sequence whose newest token is still on the device (overlapped steps: its place holds
        PENDING_TOKEN, its id is previous_tokens[seq.pending_row]) is penalised for it there
        with the values the host would have used: the repetition penalty once unless a known
        token equals it, and its count one more (a new pair when it had none)."""
        mul_rows, mul_tokens, mul_values = [], [], []
        add_rows, add_tokens, add_values, add_counts = [], [], [], []
        bias_rows, bias_tokens, bias_values = [], [], []
        pending = []   # (row, its token's row in previous_tokens, params)
        for row, seq in enumerate(seqs):
            params = seq.params
            if not params.has_penalties:
                continue
            output = seq.known_output_token_ids
            if seq.num_pending_tokens:
                if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
                    pending.append((row, seq.pending_row, params))
            if params.repetition_penalty != 1.0:
                seen = np.unique(np.fromiter((*seq.prompt_token_ids, *output), dtype=np.int64))
                mul_rows.append(np.full(len(seen), row, dtype=np.int64))
                mul_tokens.append(seen)
                mul_values.append(np.full(len(seen), params.repetition_penalty, dtype=np.float32))
            if (params.frequency_penalty or params.presence_penalty) and output:
                tokens, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
                add_rows.append(np.full(len(tokens), row, dtype=np.int64))
                add_tokens.append(tokens)
                add_values.append(-(params.frequency_penalty * counts + params.presence_penalty).astype(np.float32))
                add_counts.append(counts)
            if params.logit_bias:
                bias_rows.append(np.full(len(params.logit_bias), row, dtype=np.int64))
                bias_tokens.append(np.fromiter(params.logit_bias, dtype=np.int64))
                bias_values.append(np.fromiter(params.logit_bias.values(), dtype=np.float32))
        newest = None
        if pending:   # each pending row's token, -1 in the other rows (no token equals it)
            if previous_tokens is None:
                raise RuntimeError("a pending token to penalise needs the previous step's tokens")
            newest = torch.full((len(seqs),), -1, dtype=torch.int64, device=logits.device)
            newest[self._to_device(np.asarray([r for r, _, _ in pending]))] = previous_tokens.index_select(
                0, self._to_device(np.asarray([source for _, source, _ in pending])))
        repeated = [(r, p.repetition_penalty) for r, _, p in pending if p.repetition_penalty != 1.0]
        if mul_rows or repeated:
            rows, tokens = self._cat(mul_rows, np.int64), self._cat(mul_tokens, np.int64)
            penalty = self._cat(mul_values, np.float32).to(logits.dtype)
            logits[rows, tokens] = _repeated(logits[rows, tokens], penalty)
            if repeated:
                self._repeat_pending(logits, rows, tokens, repeated, newest)
        counted = [(r, p) for r, _, p in pending if p.frequency_penalty or p.presence_penalty]
        if add_rows or counted:
            rows, tokens = self._cat(add_rows, np.int64), self._cat(add_tokens, np.int64)
            values = self._cat(add_values, np.float32).to(logits.dtype)
            if counted:
                values, rows, tokens = self._count_pending(values, rows, tokens, add_counts, add_rows, counted,
                                                           newest, seqs)
            logits.index_put_((rows, tokens), values, accumulate=True)
        if bias_rows:
            index = (self._cat(bias_rows, np.int64), self._cat(bias_tokens, np.int64))
            logits.index_put_(index, self._cat(bias_values, np.float32).to(logits.dtype), accumulate=True)

    def _repeat_pending(self, logits, rows, tokens, repeated, newest) -> None:
        """The repetition penalty of each pending token, unless one of its row's known tokens
        (rows, tokens: the pairs just penalised) equals it."""
        seen = torch.zeros(len(logits), dtype=torch.int64, device=logits.device).index_add_(
            0, rows, (tokens == newest[rows]).long())
        pending_rows = self._to_device(np.asarray([r for r, _ in repeated]))
        penalty = self._to_device(np.asarray([v for _, v in repeated], dtype=np.float32)).to(logits.dtype)
        index = (pending_rows, newest[pending_rows])
        values = logits[index]
        logits[index] = torch.where(seen[pending_rows] > 0, values, _repeated(values, penalty))

    def _count_pending(self, values, rows, tokens, add_counts, add_rows, counted, newest, seqs):
        """The additive penalties' (row, token, value) with each pending token counted: a known
        pair equal to it gets the value of one more count (-(frequency * (count + 1) +
        presence), computed in float64 as the host does), and each pending row one more pair,
        its token's first count, or 0 where a known pair already took it."""
        match = tokens == newest[rows]
        if add_rows:
            entry_params = [seqs[int(block[0])].params for block in add_rows]
            sizes = [len(block) for block in add_rows]
            frequency = self._to_device(np.repeat([p.frequency_penalty for p in entry_params], sizes))
            presence = self._to_device(np.repeat([p.presence_penalty for p in entry_params], sizes))
            counts = self._to_device(np.concatenate(add_counts).astype(np.float64))
            recounted = (-(frequency * (counts + 1) + presence)).to(values.dtype)
            values = torch.where(match, recounted, values)
        seen = torch.zeros(len(seqs), dtype=torch.int64, device=values.device).index_add_(0, rows, match.long())
        pending_rows = self._to_device(np.asarray([r for r, _ in counted]))
        first = self._to_device(np.asarray([-(p.frequency_penalty + p.presence_penalty) for _, p in counted],
                                           dtype=np.float64)).to(values.dtype)
        first = torch.where(seen[pending_rows] > 0, torch.zeros_like(first), first)
        return (torch.cat([values, first]), torch.cat([rows, pending_rows]),
                torch.cat([tokens, newest[pending_rows]]))

    def _cat(self, blocks: list[np.ndarray], dtype) -> torch.Tensor:
        """The host blocks joined, on the device (empty when there are none)."""
        return self._to_device(np.concatenate(blocks) if blocks else np.zeros(0, dtype=dtype))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list, normalize: bool = True) -> torch.Tensor:
        """logits: [rows, vocab] -> probabilities after temperature, top-k, top-p, min-p
        (normalize=False: up to a factor per row, all that drawing needs)."""
        device = logits.device

        def column(values, dtype=torch.float32):   # one value per row, as [rows, 1]
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).unsqueeze(1)

        logits = logits / column([p.temperature for p in params])
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_ks):
            k_max = max(top_ks)
            kth = top_tokens.topk(logits, k_max)[0]                      # [rows, k_max] sorted
            idx = column(top_ks, torch.int64) - 1
            logits = logits.masked_fill(logits < kth.gather(1, idx), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= column([p.top_p for p in params])
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        if any(p.min_p > 0 for p in params):
            min_ps = column([p.min_p for p in params])
            probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True) if normalize else probs


def _repeated(values: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL's repetition penalty on seen tokens' logits: divided if > 0, else multiplied."""
    return torch.where(values > 0, values / penalty, values * penalty)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-softmax at its token [rows], and its k largest with their ids [rows, k],
    all float64 on the device (ids are exact below 2**53), for one transfer. A token a
    grammar or a -100 bias ruled out has -inf: reported as OpenAI's -9999.0 (JSON has no -inf)."""
    # (log_softmax then a gather is faster on a CPU than logsumexp over the same rows)
    logprobs = torch.log_softmax(logits.float(), dim=-1)                                # [rows, vocab]
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).double().clamp_min(-9999.0)
    if not k:
        empty = chosen.new_empty((len(chosen), 0))
        return chosen, empty, empty
    values, ids = top_tokens.topk(logprobs, k)
    return chosen, values.double().clamp_min(-9999.0), ids.double()


def _unpack_prompt_logprobs(scored, values: list[float], at: int) -> int:
    """Append the entries of scored's pending spans, read from values[at:]; returns where
    they end. A span's flat tensor holds its count logprobs, then count * num_top top
    values, then as many top ids (ModelRunner.score_prompts)."""
    k = scored.num_top
    for _, targets in scored.pending:
        count = len(targets)
        chosen, tops, ids = at, at + count, at + count + count * k
        for j, token in enumerate(targets):
            alternatives = [(int(values[ids + j * k + r]), values[tops + j * k + r]) for r in range(k)]
            scored.entries.append((token, values[chosen + j], alternatives))
        at += count * (1 + 2 * k)
    scored.pending.clear()
    return at
