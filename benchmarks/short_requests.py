#!/usr/bin/env python3
"""A worker's own ceiling on short requests (issue 50): lines per second when the model costs nothing.

Builds a tiny random model (a 1-layer Llama of hidden size 32 with the bundled tokenizer,
or a 1-layer BERT of hidden size 32 with all-MiniLM-L6-v2's tokenizer), writes N lines of
1-token chat requests (a logprob-classification shape) or of one-text embedding requests,
and runs them as one job: through one real `pipeline worker` (`--mode worker`, Redis on
127.0.0.1:6379) or `pipeline run` (`--mode run`). What is left is the pipeline's own cost
per line: reading shards, tokenizing, scheduling, building rows, writing Parquet,
committing. Prints one JSON line per round: lines/s over the job's ledger wall time.

`--mode engine` runs the same lines through the engine alone, in this thread, in shards of
--shard-size: the engine thread's share of a worker's cost, which bounds a worker however
many cores its host has (the worker's other threads share its GIL). It prints this
thread's CPU microseconds per line in tokenizing (chat templates and the tokenizer),
admitting and stepping (scheduling, the tiny model, sampling, outputs): CPU time, so
another busy process on the machine barely moves it.

    python benchmarks/short_requests.py --kind chat --n 20000 --rounds 2
    python benchmarks/short_requests.py --kind embed --n 20000 --profile /tmp/worker.txt
    python benchmarks/short_requests.py --kind chat --mode engine --rounds 3

--profile FILE records the worker with py-spy (if installed) during the last round and
writes each function's share of the samples (own and with callees), busiest first. Only
the thread holding the GIL is sampled (py-spy --gil): the worker's ceiling is what its
threads do with the GIL, and idle threads waiting would swamp the summary.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard_feed import job_row  # noqa: E402  (benchmarks/ is this script's folder)

WORDS = ("the service was quick and the food arrived warm but the bill was wrong twice and "
         "nobody answered the phone after six so we left a note for the manager").split()


def tiny_llama(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models.bundled import bundled_model_dir
    bundled = bundled_model_dir()
    torch.manual_seed(0)
    vocab = LlamaConfig.from_pretrained(bundled).vocab_size
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                 tie_word_embeddings=True)).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (bundled / name).exists():
            shutil.copy(bundled / name, out / name)
    return out


def tiny_bert(out: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from pipeline.models.bundled import embedding_model_dir
    minilm = embedding_model_dir()
    torch.manual_seed(0)
    vocab = BertConfig.from_pretrained(minilm).vocab_size
    BertModel(BertConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=512)).save_pretrained(out)
    for path in Path(minilm).iterdir():   # tokenizer files and sentence-transformers' pooling config
        if path.is_file() and not path.name.endswith((".safetensors", ".bin", "config.json")) or \
                path.name in ("sentence_bert_config.json", "config_sentence_transformers.json", "modules.json"):
            shutil.copy(path, out / path.name)
        elif path.is_dir():
            shutil.copytree(path, out / path.name, dirs_exist_ok=True)
    return out


def write_lines(kind: str, n: int, out: Path) -> Path:
    with out.open("w") as f:
        for i in range(n):
            text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(8 + i % 17)) + f" (review {i})"
            if kind == "chat":
                line = {"id": f"r{i}", "messages": [{"role": "user", "content": f"Positive or negative? {text}"}],
                        "max_tokens": 1, "temperature": 0, "logprobs": 2}
            else:
                line = {"id": f"r{i}", "input": text}
            f.write(json.dumps(line) + "\n")
    return out


def engine_requests(kind: str, path: Path) -> list:
    """The lines of path as engine requests, as a worker makes them (greedy, 1 token, 2 logprobs)."""
    from pipeline.pooling_params import PoolingParams
    from pipeline.request import Request
    from pipeline.sampling_params import SamplingParams
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    if kind == "embed":
        return [Request(line["id"], prompt=line["input"], pooling=PoolingParams()) for line in lines]
    return [Request(line["id"], messages=line["messages"], params=SamplingParams(
        temperature=0.0, max_tokens=line["max_tokens"], logprobs=line["logprobs"])) for line in lines]


def engine_round(engine, requests: list, shard_size: int) -> dict:
    """requests through the engine, a shard at a time: this thread's CPU us per line in each part."""
    spent = collections.Counter()

    def timed(part: str, fn, *args):
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent[part] += time.thread_time() - start

    done, wall = 0, time.perf_counter()
    for at in range(0, len(requests), shard_size):
        shard = requests[at:at + shard_size]
        refused = timed("admit_us", engine.add_requests, shard, timed("tokenize_us", engine.tokenize_batch, shard))
        done += sum(map(len, refused))
        while engine.has_unfinished_requests:
            done += len(timed("step_us", engine.step))
    if done != len(requests):
        raise RuntimeError(f"{done} results for {len(requests)} requests")
    wall = time.perf_counter() - wall
    return {"lines_per_s": round(len(requests) / wall, 1),
            **{part: round(spent[part] / len(requests) * 1e6, 1) for part in ("tokenize_us", "admit_us", "step_us")},
            "engine_thread_us": round(sum(spent.values()) / len(requests) * 1e6, 1)}


def cli(*args, env) -> str:
    return subprocess.run([sys.executable, "-m", "cli", *args], env=env, text=True, capture_output=True,
                          check=True).stdout


def wall_s(row: dict) -> float:
    start = datetime.fromisoformat(row["started_at"] or row["created_at"])
    return (datetime.fromisoformat(row["finished_at"]) - start).total_seconds()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) so far of pid and of its live child processes (a tokenizer pool's)."""
    def one(p) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
                and (d / "stat").exists() and _ppid(d) == pid]
    return one(pid) + sum(one(c) for c in children)


def _ppid(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def profile_summary(raw: Path, out: Path) -> None:
    """py-spy's raw (collapsed) stacks -> each function's share of the samples, own and total."""
    own, total, samples = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, count = stack.split(";"), int(count)
        samples += count
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    with out.open("w") as f:
        f.write(f"{samples} samples\n\n== total (with callees)\n")
        for frame, c in total.most_common(80):
            f.write(f"{100 * c / samples:6.1f}%  {frame}\n")
        f.write("\n== own\n")
        for frame, c in own.most_common(60):
            f.write(f"{100 * c / samples:6.1f}%  {frame}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("chat", "embed"), default="chat")
    ap.add_argument("--mode", choices=("worker", "run", "engine"), default="worker")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--shard-size", default="256", help='lines a shard (256), or "auto" (not with --mode engine)')
    ap.add_argument("--engine-args", default="", help='more engine options, e.g. "--max-num-seqs 256"')
    ap.add_argument("--worker-args", default="", help='options of `pipeline worker` alone, e.g. "--concurrency 2"')
    ap.add_argument("--profile", type=Path, help="py-spy the worker during the last round; summary to this file")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="short-requests-"))
    model = (tiny_llama if args.kind == "chat" else tiny_bert)(tmp / "model")
    if args.mode == "engine":
        from pipeline.config import EngineConfig
        from pipeline.engine.factory import build_engine
        engine = build_engine(EngineConfig(device="cpu", model=str(model), dtype="float32"))
        for r in range(args.rounds):
            requests = engine_requests(args.kind, write_lines(args.kind, args.n, tmp / f"round{r}.jsonl"))
            print(json.dumps({"kind": args.kind, "mode": "engine", "round": r, "lines": args.n,
                              **engine_round(engine, requests, int(args.shard_size))}), flush=True)
        return
    env = {**os.environ, "PIPELINE_DATA_DIR": str(tmp / "data"), "PIPELINE_QUEUE": f"bench-{uuid.uuid4().hex[:8]}"}
    env.pop("PIPELINE_DATABASE_URL", None)   # the data dir's SQLite ledger
    db = tmp / "data" / "ledger.sqlite"
    engine_args = ["--model", str(model), "--dtype", "float32", *args.engine_args.split()]
    cli("db", "upgrade", env=env)
    worker = None
    if args.mode == "worker":
        log = open(tmp / "worker.log", "wb")
        worker = subprocess.Popen([sys.executable, "-m", "cli", "worker", "--loglevel", "warning", *engine_args,
                                   *args.worker_args.split()],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        warm = write_lines(args.kind, 8, tmp / "warm.jsonl")
        cli("submit", str(warm), "--wait", "--no-reuse", *engine_args, env=env)
    try:
        for r in range(args.rounds):
            requests = write_lines(args.kind, args.n, tmp / f"round{r}.jsonl")
            spy = None
            cpu_before = cpu_s(worker.pid) if worker is not None else None
            if args.profile and r == args.rounds - 1 and worker is not None:
                spy = subprocess.Popen(["py-spy", "record", "--gil", "--format", "raw", "--rate", "250",
                                        "-o", str(tmp / "spy.raw"), "-p", str(worker.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if args.mode == "worker":
                job_id = cli("submit", str(requests), "--wait", "--no-reuse", "--shard-size", str(args.shard_size),
                             *engine_args, env=env).strip().splitlines()[0]
            else:
                cli("run", str(requests), "--no-reuse", "--shard-size", str(args.shard_size),
                          *engine_args, env=env)
                job_id = None
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
                profile_summary(tmp / "spy.raw", args.profile)
            if job_id is None:   # `pipeline run`: its own job, the newest in the ledger
                with sqlite3.connect(db) as conn:
                    job_id = conn.execute("SELECT id FROM jobs ORDER BY created_at DESC LIMIT 1").fetchone()[0]
            row = job_row(db, job_id)
            line = {"kind": args.kind, "mode": args.mode, "round": r, "lines": args.n, "status": row["status"],
                    "wall_s": round(wall_s(row), 2), "lines_per_s": round(args.n / wall_s(row), 1)}
            if cpu_before is not None:   # the worker's and its tokenizer processes' CPU time per line
                line["cpu_us_per_line"] = round((cpu_s(worker.pid) - cpu_before) / args.n * 1e6, 1)
            print(json.dumps(line), flush=True)
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)


if __name__ == "__main__":
    main()
