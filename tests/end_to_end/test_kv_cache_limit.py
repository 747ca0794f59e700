"""A request the KV cache cannot hold to its end is refused, as its own error row, and the
dry run of `pipeline run` reports the engine's real limit (the least of the model's
context and what the KV cache holds) rather than the model's context.

What "cannot hold" means (pipeline.engine.scheduler.Scheduler.admission_error): the tokens
a request may reach, its prompt plus max_tokens up to the context length, exceed the
whole cache. Cut at the cache's size it would end `length` where the model and the
request allow more: an answer a larger cache would not give, stored and reused as if
complete. Past the context it is still cut, `length`, as the model's context cuts it.
"""
from __future__ import annotations

import json
import random

from jobs.dry_run import kv_cache_tokens
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from pipeline import Engine, EngineConfig, Request
from cli import main
from pipeline.models.loader import resolve_model_dir
from cluster import TINY_CONTEXT, write_jsonl
from engine_helpers import all_blocks_free, check_output, greedy, random_prompt, run

CACHE = dict(num_kv_blocks=6, block_size=16)   # 96 tokens of KV cache in all


def test_a_request_the_cache_cannot_hold_fails_alone_and_the_others_run_to_their_end(tiny_model_dir):
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), **CACHE))
    rng = random.Random(0)
    outs = run(engine, [
        Request("fits", prompt_token_ids=random_prompt(rng, 10), params=greedy(86, ignore_eos=True)),
        Request("grows-past", prompt_token_ids=random_prompt(rng, 10), params=greedy(87, ignore_eos=True)),
        Request("prompt-past", prompt_token_ids=random_prompt(rng, 100), params=greedy(1)),
    ])
    # Before: "grows-past" ended `length` after 86 tokens, no error, as if complete.
    past = outs["grows-past"]
    assert (past.finish_reason, past.token_ids, past.output_tokens, past.prompt_tokens) == ("error", [], 0, 10)
    assert "may need 97 tokens of KV cache (10 prompt tokens plus max_tokens 87)" in past.error
    assert "the whole cache holds 96" in past.error and "kv_cache_gib" in past.error
    assert outs["prompt-past"].finish_reason == "error" and "100 prompt tokens" in outs["prompt-past"].error
    check_output(outs["fits"], engine)
    assert (outs["fits"].finish_reason, outs["fits"].output_tokens) == ("length", 86)
    # Three choices share the prompt's blocks; each may grow to 20 + 70 tokens alone.
    choices = [out for out in engine.generate([Request("n3", prompt_token_ids=random_prompt(rng, 20),
                                                       params=greedy(70, ignore_eos=True, n=3))])]
    assert sorted(out.choice for out in choices) == [0, 1, 2]
    assert all(out.finish_reason == "length" and out.output_tokens == 70 for out in choices)
    assert all_blocks_free(engine)


def test_the_models_context_still_cuts_with_length_where_the_cache_holds_it(tiny_model_dir):
    """A request whose max_tokens reach past the context is cut there, as before: the cache
    (8,192 tokens here) holds the whole context, so nothing a larger cache would change."""
    engine = Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), num_kv_blocks=512, block_size=16))
    prompt = random_prompt(random.Random(1), TINY_CONTEXT - 3)
    out = run(engine, [Request("edge", prompt_token_ids=prompt, params=greedy(50, ignore_eos=True))])["edge"]
    assert (out.finish_reason, out.output_tokens, out.error) == ("length", 3, None)


def test_pipeline_run_refuses_it_as_its_row_and_the_dry_run_says_the_engines_limit(runner, data_root, tmp_path,
                                                                                 tiny_model_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "fits", "prompt": "Hi", "max_tokens": 40, "ignore_eos": True},
        {"id": "grows-past", "prompt": "Hi", "max_tokens": 200},
    ])
    engine = ["--model", str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "6", "--block-size", "16"]
    dry = runner.invoke(main, ["run", str(src), *engine, "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    figures = json.loads(dry.stdout)
    # Before: context_length 2048 was the only limit said, and over_context 0.
    assert (figures["context_length"], figures["kv_cache_tokens"], figures["max_model_len"]) == (TINY_CONTEXT, 96, 96)
    assert figures["over_context"] == 1
    text = runner.invoke(main, ["run", str(src), *engine, "--dry-run"]).stdout
    assert "too long for the engine (its KV cache holds 96 tokens, prompt plus max_tokens; the model's context " \
           "is 2,048): 1" in text, text
    # A submitted job runs on the workers' engines, sized by their own options: not known here.
    submitted = json.loads(runner.invoke(main, ["submit", str(src), *engine, "--dry-run", "--json"]).stdout)
    assert (submitted["kv_cache_tokens"], submitted["max_model_len"], submitted["over_context"]) == (
        None, TINY_CONTEXT, 0)

    done = runner.invoke(main, ["run", str(src), *engine])
    assert done.exit_code == 0, done.output   # the job completes; the request fails alone
    (job_dir,) = (data_root / "jobs").iterdir()
    rows = {r["id"]: r for r in read_results(JobPaths(data_root, job_dir.name).results_dir).to_pylist()}
    assert rows["fits"]["finish_reason"] == "length" and rows["fits"]["output_tokens"] == 40
    assert rows["grows-past"]["finish_reason"] == "error" and rows["grows-past"]["output"] in ("", None)
    assert "the whole cache holds 96" in rows["grows-past"]["error"]
    assert "1 completed, 1 failed" in done.stdout


def test_the_dry_runs_cache_size_is_the_engines(tiny_model_dir):
    """kv_cache_tokens sizes the cache without building the engine: the same figure as the
    engine's pool, for the budgets and dtypes that change it."""
    for options in ({"kv_cache_gib": 0.001}, {"kv_cache_gib": 0.001, "kv_cache_dtype": "int8"},
                    {"kv_cache_gib": 0.001, "dtype": "bfloat16", "block_size": 8}, {"num_kv_blocks": 10}):
        options = {"model": str(tiny_model_dir), "device": "cpu", **options}
        engine = Engine(EngineConfig(**options))
        expected = engine.block_manager.num_blocks * engine.block_size
        assert kv_cache_tokens(options, resolve_model_dir(options["model"])) == expected, options
