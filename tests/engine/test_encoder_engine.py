"""all-MiniLM-L6-v2 through the EncoderEngine: vectors equal sentence-transformers' encode,
and they carry meaning."""
from __future__ import annotations

import pytest
import torch

from pipeline import EngineConfig, Request, build_engine
from pipeline.engine.encoder_engine import EncoderEngine
from pipeline.pooling_params import PoolingParams
from tests.engine_helpers import run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["the cat sat on the mat", "a feline rested on the rug", "quarterly revenue grew 8%",
         "Embedding jobs run every night over the whole catalogue, " * 6, "ok", "Paris is the capital of France."]


@pytest.fixture(scope="module")
def encoder(minilm_dir):
    engine = build_engine(EngineConfig(model=str(minilm_dir), dtype="float32"))
    assert isinstance(engine, EncoderEngine)
    return engine


def embed(engine, texts, dimensions=None) -> list[torch.Tensor]:
    outs = run(engine, [Request(f"t{i}", prompt=t, pooling=PoolingParams(dimensions)) for i, t in enumerate(texts)])
    assert all(outs[f"t{i}"].error is None for i in range(len(texts)))
    return [torch.tensor(outs[f"t{i}"].embedding) for i in range(len(texts))]


def test_vectors_equal_sentence_transformers(encoder, minilm_dir):
    from sentence_transformers import SentenceTransformer
    expected = SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = embed(encoder, TEXTS)
    for g, want in zip(got, expected):
        assert g.shape == (384,) and abs(g.norm().item() - 1) < 1e-5
        assert torch.nn.functional.cosine_similarity(g, want, dim=0).item() >= 0.9999


def test_similar_sentences_are_closer(encoder):
    cat, feline, revenue = embed(encoder, TEXTS[:3])
    assert cat @ feline > cat @ revenue + 0.2


def test_dimensions_token_counts_and_errors(encoder):
    full, cut = embed(encoder, [TEXTS[0]])[0], embed(encoder, [TEXTS[0]], dimensions=64)[0]
    assert cut.shape == (64,) and torch.allclose(cut, torch.nn.functional.normalize(full[:64], dim=0), atol=1e-5)
    outs = run(encoder, [Request("long", prompt="word " * 400, pooling=PoolingParams()),
                         Request("gen", prompt="hello"),
                         Request("ok", prompt_token_ids=[101, 7592, 102], pooling=PoolingParams())])
    assert "the input has 402 tokens; the model takes at most 256" in outs["long"].error
    assert "is an encoder: it embeds and cannot generate" in outs["gen"].error
    assert outs["ok"].error is None and outs["ok"].prompt_tokens == 3
    assert torch.allclose(torch.tensor(outs["ok"].embedding), embed(encoder, ["hello"])[0], atol=1e-5)
    assert not encoder.has_unfinished_requests


def test_a_token_id_beyond_the_vocabulary_fails_its_own_input_only(encoder):
    outs = run(encoder, [Request("bad", prompt_token_ids=[101, 30522, 102], pooling=PoolingParams()),
                         Request("ok", prompt_token_ids=[101, 7592, 102], pooling=PoolingParams())])
    assert outs["bad"].error == "token id 30522 is not in the model's vocabulary (ids 0 to 30521)"
    assert outs["ok"].error is None and len(outs["ok"].embedding) == 384
