"""Embedding jobs end to end: all-MiniLM-L6-v2 through `pipeline run` (vectors equal
sentence-transformers', Parquet readable as vectors by DuckDB, OpenAI output lines, stats
and status), and a worker SIGKILLed mid-job on the tiny decoder (every (id, input) once)."""
from __future__ import annotations

import json
import random
import re

import duckdb
import pytest
import torch
from openai.types import CreateEmbeddingResponse

from cluster import Cluster
from jobs.ledger import get_job, make_engine, session_factory
from jobs.paths import JobPaths, default_database_url
from jobs.results.parquet_files import read_results
from cli import main

TEXTS = {"cat": "the cat sat on the mat", "feline": "a feline rested on the rug",
         "revenue": "quarterly revenue grew 8%", "paris": "Paris is the capital of France."}


def test_an_embedding_job_on_minilm_equals_sentence_transformers(runner, data_root, tmp_path, minilm_dir):
    from sentence_transformers import SentenceTransformer
    lines = [{"id": cid, "input": text} for cid, text in TEXTS.items()]
    lines += [{"id": "pair", "input": [TEXTS["cat"], TEXTS["paris"]], "dimensions": 32},
              {"id": "long", "input": "word " * 300}]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = runner.invoke(main, ["run", str(src), "--model", str(minilm_dir), "--device", "cpu"])
    assert done.exit_code == 0, done.output
    job_id = re.search(r"job (job_[0-9a-f]{16})", done.stdout)[1]
    assert "vectors/s" in done.stdout, done.stdout
    results = JobPaths(data_root, job_id).results_dir
    rows = {(r["id"], r["choice"]): r for r in read_results(results).to_pylist()}
    assert sorted(rows) == sorted([*((cid, 0) for cid in TEXTS), ("pair", 0), ("pair", 1), ("long", 0)])
    assert rows["long", 0]["finish_reason"] == "error" and "the model takes at most 256" in rows["long", 0]["error"]
    expected = SentenceTransformer(str(minilm_dir), device="cpu").encode(list(TEXTS.values()), convert_to_tensor=True)
    for cid, want in zip(TEXTS, expected):
        got = torch.tensor(rows[cid, 0]["embedding"])
        assert rows[cid, 0]["finish_reason"] == "stop" and rows[cid, 0]["prompt_tokens"] > 2
        assert torch.nn.functional.cosine_similarity(got, want, dim=0).item() >= 0.9999
    assert len(rows["pair", 0]["embedding"]) == 32 and rows["pair", 0]["embedding"][:4] == pytest.approx(
        (torch.nn.functional.normalize(torch.tensor(rows["cat", 0]["embedding"][:32]), dim=0)[:4]).tolist(), abs=1e-5)
    # DuckDB reads the column as a vector: the cat is nearer the feline than the revenue.
    near = duckdb.sql(f"""
        WITH v AS (SELECT id, embedding::FLOAT[384] AS e FROM '{results}/*.parquet'
                   WHERE id IN ('cat', 'feline', 'revenue'))
        SELECT b.id FROM v a, v b WHERE a.id = 'cat' AND b.id <> 'cat'
        ORDER BY array_cosine_similarity(a.e, b.e) DESC LIMIT 1""").fetchall()[0][0]
    assert near == "feline"
    with session_factory(make_engine(default_database_url(data_root)))() as s:
        job = get_job(s, job_id)
    assert (job.embedding_vectors, job.completed_requests, job.failed_requests) == (6, 5, 1)
    assert job.vectors_s > 0 and job.endpoint == "/v1/embeddings" and job.output_tokens == 0
    out = tmp_path / "out.jsonl"
    assert runner.invoke(main, ["results", job_id, "--format", "openai", "--output-file", str(out)]).exit_code == 0
    bodies = {line["custom_id"]: CreateEmbeddingResponse.model_validate(line["response"]["body"])
              for line in map(json.loads, out.read_text().splitlines())}
    assert set(bodies) == {*TEXTS, "pair"} and [d.index for d in bodies["pair"].data] == [0, 1]
    assert bodies["cat"].data[0].embedding == pytest.approx(rows["cat", 0]["embedding"])


def test_sigkill_mid_embedding_shard_every_input_once(sqlite_url, cluster_factory):
    """Embedding lines of many inputs each (token ids on the tiny decoder): a worker killed
    while it embeds a long shard, the survivor redoes it, each (id, input) exactly once.
    Both workers hold their long shards once an input is under way (tests/hold.py) until
    the kill: a fast machine embedded a whole shard in 0.35 s, too quick to be caught."""
    c: Cluster = cluster_factory(sqlite_url)
    rng = random.Random(0)
    warm = [{"id": f"w{i}", "input": "hello"} for i in range(4)]
    long = [{"id": f"held-k{i:02d}", "input": [[rng.randrange(100, 40000) for _ in range(480)] for _ in range(48)]}
            for i in range(18)]
    workers = [c.start_worker(held=True) for _ in range(2)]
    job_id = c.submit(warm + long, shard_size=3)
    victim = c.wait_for("a long shard embedding", lambda: c.running_mid_generation(job_id, long_from=2))
    a = c.wait_for("the victim's worker process",
                   lambda: next((p for p in workers if victim.worker.endswith(f":{p.pid}")), None))
    a.kill()
    a.wait()
    c.release()
    job = c.wait_until_ended(job_id)
    assert job.status == "completed" and job.completed_requests == len(warm) + len(long)
    c.assert_exactly_once(job_id, [r["id"] for r in warm + long], {r["id"]: 48 for r in long})
    redone = next(sh for sh in c.shards(job_id) if sh.index == victim.index)
    assert redone.status == "completed" and redone.attempt > victim.attempt
    rows = read_results(JobPaths(c.root, job_id).results_dir).to_pylist()
    assert all(len(r["embedding"]) == 64 for r in rows)   # the tiny model's hidden size
    assert all(r["prompt_tokens"] == 480 for r in rows if r["id"].startswith("held-k"))


def test_a_generation_file_for_an_encoder_is_refused_whole(runner, data_root, tmp_path, minilm_dir):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"id": "q", "prompt": "Hello"}) + "\n")
    done = runner.invoke(main, ["run", str(src), "--model", str(minilm_dir), "--device", "cpu"])
    assert done.exit_code == 2 and "is an encoder: it embeds and cannot generate" in done.output, done.output
    assert not (data_root / "jobs").exists()   # nothing was created
