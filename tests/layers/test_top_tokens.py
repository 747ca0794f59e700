"""top_tokens: argmax and topk of logits rows, against torch's own, ties and odd vocabularies included."""
from __future__ import annotations

import pytest
import torch

from pipeline.layers import top_tokens


@pytest.mark.parametrize("vocab", [49152, 49155, 130, 128, 5])
def test_argmax_and_topk_agree_with_torch(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(17, vocab, generator=g)
    x[2, :] = float("-inf")
    x[2, vocab - 1] = 0.0                        # the maximum in a short last chunk
    x[3, 0] = x[3, vocab - 1] = x[3].max() + 1   # a tie: the first one wins, as torch.argmax's
    x[4, vocab // 2] = float("inf")
    assert torch.equal(top_tokens.argmax(x), x.argmax(dim=-1))
    for k in {1, min(5, vocab), min(20, vocab)}:
        values, ids = top_tokens.topk(x, k)
        assert torch.equal(values, x.topk(k, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values) and ids.unique(dim=1).shape[1] == k
