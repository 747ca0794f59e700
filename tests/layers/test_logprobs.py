"""Logprobs: the model's own distribution per output token, in the engine, the results and
OpenAI's chat and completions shapes (the tiny random Llama against transformers)."""
from __future__ import annotations

import json
import re

import duckdb
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion

from jobs.paths import JobPaths
from pipeline import Engine, EngineConfig, Request, SamplingParams
from cli import main

PROMPT = "Once upon a time"
FAST = ["--kv-cache-gib", "0.05", "--device", "cpu", "--dtype", "float32"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), num_kv_blocks=256))


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at each output position: [len(output), vocab]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
    return logits[len(prompt_ids) - 1:-1].log_softmax(-1)


def test_logprobs_are_the_models_log_softmax_and_greedy_is_their_top_1(engine, hf_tiny):
    requests = [Request("greedy", prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                       logprobs=5)),
                Request("sampled", prompt=PROMPT, params=SamplingParams(temperature=1.0, seed=7, max_tokens=8,
                                                                        ignore_eos=True, logprobs=0)),
                Request("none", prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    outs = {o.id: o for o in engine.generate(requests)}
    prompt_ids = engine.tokenize(requests[0])
    greedy = outs["greedy"]
    assert len(greedy.logprobs) == len(greedy.token_ids) == 8
    reference = reference_logprobs(hf_tiny, prompt_ids, greedy.token_ids)
    for position, (token, entry) in enumerate(zip(greedy.token_ids, greedy.logprobs)):
        top = entry.top
        assert entry.token_id == token and [t.token_id for t in top] == reference[position].topk(5).indices.tolist()
        assert len(top) == 5 and top[0].text == entry.text == engine.tokenizer.decode([token])
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # float32 on both sides, the same weights: within 1e-4 (seen: equal)
        assert entry.logprob == pytest.approx(reference[position, token].item(), abs=1e-4)
        want = reference[position].topk(5)
        assert [t.logprob for t in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    sampled = outs["sampled"]
    reference = reference_logprobs(hf_tiny, prompt_ids, sampled.token_ids)
    assert [e.logprob for e in sampled.logprobs] == pytest.approx(
        [reference[i, t].item() for i, t in enumerate(sampled.token_ids)], abs=1e-4)
    assert [e.token_id for e in sampled.logprobs] == sampled.token_ids
    assert all(e.top == () for e in sampled.logprobs)
    assert outs["none"].logprobs is None and outs["none"].token_ids == greedy.token_ids


def openai_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_openai_lines_get_logprobs_in_their_endpoints_shape(runner, data_root, tmp_path, tiny_model_dir, url):
    chat = url == "/v1/chat/completions"
    ask = ({"messages": [{"role": "user", "content": PROMPT}], "logprobs": True, "top_logprobs": 3} if chat
           else {"prompt": PROMPT, "logprobs": 3})
    rows = [openai_line("lp", url, {**ask, "temperature": 0, "max_tokens": 6}),
            openai_line("plain", url, {"temperature": 0, "max_tokens": 6,
                                       **({"messages": ask["messages"]} if chat else {"prompt": PROMPT})})]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), *FAST])
    assert done.exit_code == 0, done.output
    job_id = re.search(r"job (job_[0-9a-f]{16})", done.stderr)[1]
    out = tmp_path / "out.jsonl"
    assert runner.invoke(main, ["results", job_id, "--export", str(out), "--format", "openai"]).exit_code == 0
    lines = {line["custom_id"]: line["response"]["body"] for line in map(json.loads, out.read_text().splitlines())}
    if chat:
        body = ChatCompletion.model_validate(lines["lp"])
        content = body.choices[0].logprobs.content
        assert len(content) == body.usage.completion_tokens
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)
        assert "".join(e.token for e in content) == body.choices[0].message.content
        assert ChatCompletion.model_validate(lines["plain"]).choices[0].logprobs is None
    else:
        body = Completion.model_validate(lines["lp"])
        logprobs = body.choices[0].logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == body.usage.completion_tokens
        assert all(max(top, key=top.get) == token for top, token in zip(logprobs.top_logprobs, logprobs.tokens))
        assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == body.choices[0].text
    results = JobPaths(data_root, job_id).results_dir
    ((n,),) = duckdb.sql(f"select count(*) from (select unnest(logprobs) from read_parquet('{results}/*.parquet'))"
                         ).fetchall()
    assert n == 6   # DuckDB reads the nested column: one entry per token of the line that asked


def prompt_reference(model, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at each prompt position but the last: [len - 1, vocab]."""
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0, :-1].log_softmax(-1)


# The prompt in one step, or in chunks of 7 tokens; its rows' logits in one piece (85 rows of
# this vocabulary fit the runner's 16 MB), or 5 rows at a time.
@pytest.mark.parametrize("chunk, logit_rows", [(512, None), (7, None), (512, 5)])
def test_prompt_logprobs_are_the_models_log_softmax_however_the_prompt_is_chunked(tiny_model_dir, hf_tiny, chunk,
                                                                                  logit_rows, monkeypatch):
    engine = Engine(EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), num_kv_blocks=256,
                                 max_num_batched_tokens=chunk, enable_prefix_caching=True))
    if logit_rows:
        from pipeline.engine import model_runner
        monkeypatch.setattr(model_runner, "CPU_LOGITS_CHUNK_BYTES", logit_rows * 4 * engine.model.args.vocab_size)
    prompt = "Once upon a time, in a land far away, there lived a small dragon who loved to read."
    params = dict(temperature=0, max_tokens=3, ignore_eos=True)
    # The same prompt first without prompt logprobs, so its blocks are in the prefix cache.
    (warm,) = engine.generate([Request("warm", prompt=prompt, params=SamplingParams(**params))])
    outs = {(o.id, o.choice): o for o in engine.generate([
        Request("p", prompt=prompt, params=SamplingParams(**params, prompt_logprobs=3, n=2)),
        Request("other", prompt="Hello there", params=SamplingParams(**params, logprobs=1))])}
    prompt_ids = engine.tokenize(Request("x", prompt=prompt))
    reference = prompt_reference(hf_tiny, prompt_ids)
    entries = outs["p", 0].prompt_logprobs
    assert outs["p", 0].cached_tokens == 0   # computed, not taken from the cache: its logits are needed
    assert len(entries) == len(prompt_ids) and entries[0].logprob is None and entries[0].top is None
    assert [e.token_id for e in entries] == prompt_ids
    assert [e.text for e in entries] == [engine.tokenizer.decode([t]) for t in prompt_ids]
    for position, entry in enumerate(entries[1:]):
        token = prompt_ids[position + 1]
        assert entry.logprob == pytest.approx(reference[position, token].item(), abs=1e-4)
        assert [t.logprob for t in entry.top] == pytest.approx(
            reference[position].topk(3).values.tolist(), abs=1e-4)
    assert outs["p", 1].prompt_logprobs == entries   # the choices share one prompt
    assert outs["p", 0].token_ids == warm.token_ids
    assert outs["other", 0].prompt_logprobs is None and len(outs["other", 0].logprobs) == 3


def test_a_step_with_prompt_logprobs_still_makes_one_host_transfer(tiny_model_dir, monkeypatch):
    engine = Engine(EngineConfig(device="cpu", dtype="float32", model=str(tiny_model_dir), num_kv_blocks=256,
                                 max_num_batched_tokens=8))
    for i in range(3):
        engine.add_request(Request(f"r{i}", prompt_token_ids=list(range(10 + i, 40 + i)),
                                   params=SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)))
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1) or real(self))
    finished = []
    while engine.has_unfinished_requests:
        before = len(calls)
        finished += engine.step()
        assert len(calls) - before <= 1
    assert sorted(len(o.prompt_logprobs) for o in finished) == [30, 30, 30]
