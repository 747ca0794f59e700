"""Helpers of the `pipeline serve` tests (tests/api): a real server process on a SQLite ledger,
with or without a real worker, its API keys, batch lines, and a wait for a batch to end."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
from openai import OpenAI
from openai.types import Batch

from polling import wait_until
from worker_process import BROKER_URL, drop_queue, worker

CHAT = "/v1/chat/completions"
MAX_UPLOAD = 256 * 1024
ENDED = ("completed", "failed", "cancelled", "expired")
TOO_LONG = "word " * 10_000   # over the bundled model's 8192 positions: that request fails

CHATS = {
    "capital": [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}],
    "greet": [{"role": "user", "content": "Hello! Who are you?"}],
    "long": [{"role": "user", "content": TOO_LONG}],
}
# Lines may name the model as the bundled directory does, or as a hosted API's file would.
SERVED_AS = ["--served-model-name", "SmolLM2-135M-Instruct", "--served-model-name", "gpt-4o-mini"]
KEYS = (("team-a",), ("team-b",), ("team-c",), ("team-d",), ("lab-1", "--share-answers", "lab"),
        ("lab-2", "--share-answers", "lab"))


def batch_line(custom_id, messages, **body):
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "SmolLM2-135M-Instruct", "messages": messages, "temperature": 0, **body}}


BAD_ROWS = [batch_line("a", [{"role": "user", "content": "Hi"}]),
            {**batch_line("b", [{"role": "user", "content": "Hi"}]), "method": "GET"},
            batch_line("c", [{"role": "user", "content": "Hi"}], n=129),
            batch_line("d", [{"role": "user", "content": "Hi"}], model="gpt-4o")]


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root, env, base_url, keys, worker_log: Path | None):
        self.root, self.env, self.base_url, self.keys = root, env, base_url, keys
        self.worker_log = worker_log

    def client(self, key: str | None = None) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key or self.keys["team-a"], max_retries=0, timeout=60)

    def stored_files(self) -> list[str]:
        """Every name under <data root>/files (hidden temporary uploads too)."""
        files = self.root / "files"
        return sorted(p.name for p in files.iterdir()) if files.exists() else []

    def wait_held(self, request_id_prefix: str) -> None:
        """Until the worker (started held) holds a request of this prefix mid-generation."""
        wait_until(f"the worker to hold {request_id_prefix}* mid-generation",
                   lambda: f"held: {request_id_prefix}" in self.worker_log.read_text(errors="replace"),
                   diagnostics=lambda: self.worker_log.read_text(errors="replace")[-3000:])


@contextlib.contextmanager
def serving(tmp: Path, with_worker: bool, held: bool = False, models: tuple[str, ...] = (),
            served_as: tuple[str, ...] = ()):
    """`pipeline serve` (shards of 2, on the CPU, the bundled model served as SERVED_AS, or
    --model each of models, with --served-model-name each of served_as) on a fresh data root with
    the SQLite ledger and the API keys of KEYS, and with_worker a `pipeline worker` of the same
    models (one shard in flight; held: under tests/hold.py's hold); all stopped at the end."""
    from click.testing import CliRunner

    from cli import main

    root, queue = tmp / "data", f"pipeline-test-api-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PIPELINE_DATA_DIR": str(root), "PIPELINE_BROKER_URL": BROKER_URL,
           "PIPELINE_QUEUE": queue, "PIPELINE_SHARDS_IN_FLIGHT": "1", "PIPELINE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    env.pop("PIPELINE_DATABASE_URL", None)   # the SQLite ledger in the data root
    keys = {}
    for name, *shared in KEYS:
        done = CliRunner().invoke(main, ["keys", "add", name, *shared], env=env)
        assert done.exit_code == 0, done.output
        keys[name] = done.stdout.strip()
    port = free_port()
    log_path = tmp / "serve.log"
    log = open(log_path, "wb")
    model_args = [arg for model in models for arg in ("--model", str(model))]
    names = [arg for name in served_as for arg in ("--served-model-name", name)]
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port), "--shard-size", "2",
                             "--device", "cpu", "--kv-cache-gib", "0.1", *(model_args + names or SERVED_AS)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"

        def answering() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return httpx.get(f"{base_url}/files", headers={"Authorization": f"Bearer {keys['team-a']}"}
                             ).status_code == 200

        wait_until("the server to answer", answering, timeout=60, retry=(httpx.TransportError,),
                   diagnostics=lambda: log_path.read_text())
        worker_log = tmp / "worker.log" if with_worker else None
        with (worker(env, worker_log, "--device", "cpu", "--kv-cache-gib", "0.1", *model_args, held=held)
              if with_worker else contextlib.nullcontext()):
            yield Server(root, env, base_url, keys, worker_log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        drop_queue(queue)


def raw(response) -> dict:
    """The JSON a with_raw_response call got."""
    return json.loads(response.text)


def wait_until_ended(client: OpenAI, batch_id: str, timeout: float = 300) -> Batch:
    """The batch, once it has ended (as the server reports it, validated with openai's type)."""
    return wait_until(f"batch {batch_id} to end",
                      lambda: (batch := Batch.model_validate(raw(client.batches.with_raw_response.retrieve(batch_id))))
                      .status in ENDED and batch, timeout, poll_s=0.5,
                      diagnostics=lambda: str(client.batches.retrieve(batch_id)))


def lines_of(client: OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]
