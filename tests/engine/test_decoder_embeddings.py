"""Decoder embeddings through the engine: prompts computed in the continuous batch, their
hidden states pooled (last token, mean, cls) and normalised, equal to transformers' own
hidden states pooled the same way (float32; tolerance 1e-4 on unit vectors)."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from pipeline import Engine, EngineConfig, Request
from pipeline.models.pooling_config import PoolingConfig, read_pooling_config
from pipeline.pooling_params import PoolingParams
from tests.engine_helpers import all_blocks_free, greedy, random_prompt, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-4


def with_pooling(src, dst, mode: str | None, normalize: bool = True):
    """A copy of a model directory with sentence-transformers' pooling files (mode None: none)."""
    shutil.copytree(src, dst)
    if mode is None:
        return dst
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    keys = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({k: k == keys[mode] for k in keys.values()}))
    return dst


def reference(model_dir, prompts: list[list[int]], method: str, normalize: bool = True) -> list[torch.Tensor]:
    """transformers' last hidden states (after the final norm), pooled one prompt at a time."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            v = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
            out.append(F.normalize(v, dim=0) if normalize else v)
    return out


def embed(engine, prompts, dimensions=None, prefix="e"):
    requests = [Request(f"{prefix}{i}", prompt_token_ids=p, pooling=PoolingParams(dimensions))
                for i, p in enumerate(prompts)]
    return [run(engine, requests)[r.id] for r in requests]


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooled_vectors_equal_transformers_alone_and_in_mixed_batches(tmp_path, tiny_model_dir, method):
    model_dir = with_pooling(tiny_model_dir, tmp_path / "m", method)
    rng = random.Random(0)
    # Lengths that fill blocks exactly, partly, and need several prefill chunks (64 a step).
    prompts = [random_prompt(rng, n) for n in (1, 5, 16, 33, 150, 64)]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
                                 max_num_batched_tokens=64, max_num_seqs=8))
    expected = reference(model_dir, prompts, method)
    alone = [embed(engine, [p], prefix=f"a{i}-")[0] for i, p in enumerate(prompts)]
    batched = embed(engine, prompts)
    for outs in (alone, batched):
        for out, want in zip(outs, expected):
            assert out.error is None and out.finish_reason == "stop" and out.output_tokens == 0
            assert out.prompt_tokens == len(prompts[outs.index(out)])
            got = torch.tensor(out.embedding)
            assert got.shape == want.shape
            assert abs(got.norm().item() - 1) < 1e-5
            assert (got - want).abs().max().item() < TOLERANCE
    assert all_blocks_free(engine)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory, bundled_model_dir):
    """A 2-layer random Qwen3 (q/k norms, the Qwen3-Embedding family's architecture) with the bundled tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    out = tmp_path_factory.mktemp("tiny-qwen3")
    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir / name, out / name)
    return out


@pytest.mark.parametrize("method", ["last", "mean"])
def test_a_qwen3_decoder_embeds_as_transformers_pools_it(tmp_path, tiny_qwen3_dir, method):
    model_dir = with_pooling(tiny_qwen3_dir, tmp_path / "q", method)
    rng = random.Random(4)
    prompts = [random_prompt(rng, n) for n in (3, 40, 97)]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=16,
                                 max_num_batched_tokens=64))
    for out, want in zip(embed(engine, prompts), reference(model_dir, prompts, method)):
        assert (torch.tensor(out.embedding) - want).abs().max().item() < TOLERANCE


def test_last_token_pooling_uses_cached_prefixes_and_mean_does_not(tmp_path, tiny_model_dir):
    rng = random.Random(1)
    shared = random_prompt(rng, 48)
    prompts = [shared + random_prompt(rng, 7), shared + random_prompt(rng, 20)]
    for method, cached in (("last", 48), ("mean", 0)):
        model_dir = with_pooling(tiny_model_dir, tmp_path / method, method)
        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
                                     max_num_batched_tokens=256))
        embed(engine, [prompts[0]], prefix="warm")
        out = embed(engine, [prompts[1]])[0]
        assert out.cached_tokens == cached
        want = reference(model_dir, [prompts[1]], method)[0]
        assert (torch.tensor(out.embedding) - want).abs().max().item() < TOLERANCE


def test_dimensions_truncate_and_renormalise_and_generation_shares_the_batch(tmp_path, tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
                                 max_num_batched_tokens=64))
    rng = random.Random(2)
    prompt = random_prompt(rng, 30)
    full_ref = reference(tiny_model_dir, [prompt], "last", normalize=False)[0]   # default: last, normalised
    generated = [Request(f"g{i}", prompt_token_ids=random_prompt(rng, 20), params=greedy(6)) for i in range(3)]
    embedded = [Request("full", prompt_token_ids=prompt, pooling=PoolingParams()),
                Request("cut", prompt_token_ids=prompt, pooling=PoolingParams(8)),
                Request("wide", prompt_token_ids=prompt, pooling=PoolingParams(10_000))]
    outs = run(engine, [generated[0], *embedded, *generated[1:]])
    assert torch.allclose(torch.tensor(outs["full"].embedding), F.normalize(full_ref, dim=0), atol=TOLERANCE)
    assert torch.allclose(torch.tensor(outs["cut"].embedding), F.normalize(full_ref[:8], dim=0), atol=TOLERANCE)
    assert "dimensions 10000 exceeds the model's" in outs["wide"].error
    alone = run(Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16,
                                    max_num_batched_tokens=64)), generated)
    for g in generated:   # the embedding requests beside them changed nothing in their answers
        assert outs[g.id].token_ids == alone[g.id].token_ids and outs[g.id].embedding is None
    assert all_blocks_free(engine)


def test_pooling_config_is_read_from_sentence_transformers_files(tmp_path, tiny_model_dir):
    assert read_pooling_config(tiny_model_dir, decoder=True) == PoolingConfig("last", True)
    assert read_pooling_config(tiny_model_dir, decoder=False) == PoolingConfig("mean", True)
    assert read_pooling_config(with_pooling(tiny_model_dir, tmp_path / "c", "cls", normalize=False),
                               decoder=True) == PoolingConfig("cls", False)
    bad = with_pooling(tiny_model_dir, tmp_path / "max", "mean")
    (bad / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        read_pooling_config(bad, decoder=True)


@pytest.mark.parametrize("normalize", [True, False])
def test_a_batch_of_vectors_becomes_lists_as_each_would_alone(normalize):
    """as_lists cuts and normalises a batch whose vectors keep the same dimensions as one
    matrix: the same bits as a row at a time, whatever the batch; mixed dimensions too."""
    from pipeline.layers.pooler import as_lists

    def alone(vector, d):
        row = vector[:d]
        return (F.normalize(row, dim=0) if normalize else row).tolist()

    torch.manual_seed(0)
    vectors = torch.randn(37, 384) * 3
    for rows in (1, 2, 37):
        for d in (None, 64):
            want = [alone(v, d) for v in vectors[:rows]]
            assert as_lists(vectors[:rows], [d] * rows, normalize) == want
            assert as_lists(list(vectors[:rows]), [d] * rows, normalize) == want
    mixed = [None, 64, 16, None]
    assert as_lists(list(vectors[:4]), mixed, normalize) == [alone(v, d) for v, d in zip(vectors[:4], mixed)]
