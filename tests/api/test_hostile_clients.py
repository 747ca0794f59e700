"""`pipeline serve` against what a careless or hostile client sends that no batch needs: text
the ledger cannot store (on SQLite and on PostgreSQL, whose text cannot hold a NUL), and
connections that send nothing, or their request a byte at a time.

A real server process on each ledger, with short header and body timeouts; raw httpx and
sockets for what the openai client would never send, the client where it applies. No worker:
nothing here runs a batch.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
from click.testing import CliRunner
from openai import OpenAI
from sqlalchemy import text

from jobs.ledger import make_engine
from cli import main
from polling import wait_until
from worker_process import BROKER_URL, drop_queue

CHAT = "/v1/chat/completions"
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1, 2
WAIT_S = 60   # the longest any wait here may take before the test fails


class Server:
    def __init__(self, root, db_url, port, key):
        self.root, self.db_url, self.port, self.key = root, db_url, port, key
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.headers = {"Authorization": f"Bearer {key}"}

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0, timeout=WAIT_S)

    def stored_files(self) -> list[str]:
        files = self.root / "files"
        return sorted(p.name for p in files.iterdir()) if files.exists() else []

    def count(self, table: str) -> int:
        engine = make_engine(self.db_url)
        try:
            with engine.connect() as conn:
                return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
        finally:
            engine.dispose()


@contextlib.contextmanager
def serving(tmp_path, db_url):
    root, queue = tmp_path / "data", f"pipeline-test-hostile-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PIPELINE_DATA_DIR": str(root), "PIPELINE_DATABASE_URL": db_url,
           "PIPELINE_BROKER_URL": BROKER_URL, "PIPELINE_QUEUE": queue}
    done = CliRunner().invoke(main, ["keys", "add", "team"], env=env)
    assert done.exit_code == 0, done.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port),
                                 "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(root, db_url, port, done.stdout.strip())
    try:
        def answering() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return httpx.get(f"{server.base_url}/files", headers=server.headers).status_code == 200

        wait_until("the server to answer", answering, WAIT_S, retry=(httpx.TransportError,),
                   diagnostics=lambda: log_path.read_text())
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        drop_queue(queue)
    assert "Traceback" not in log_path.read_text(), log_path.read_text()   # not one 500


@pytest.fixture
def served(tmp_path, db_url):
    with serving(tmp_path, db_url) as server:
        yield server


def line(custom_id: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}}


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()   # "\u0000" and "\ud800" as JSON escapes


def upload(server, filename: bytes, data: bytes) -> httpx.Response:
    """A multipart upload whose file name is these bytes, as sent."""
    form = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="' + filename + b'"\r\n\r\n'
            + data + b"\r\n--b--\r\n")
    return httpx.post(f"{server.base_url}/files", content=form, timeout=WAIT_S,
                      headers={**server.headers, "Content-Type": "multipart/form-data; boundary=b"})


def refused(response: httpx.Response, param: str, says: str) -> None:
    """A 400 in OpenAI's error shape (valid JSON whatever the request held), naming param."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert says in error["message"], error


def test_text_the_ledger_cannot_store_is_a_400_and_nothing_is_kept(served):
    # an upload whose file name holds a NUL byte (was: 500, the PostgreSQL insert)
    refused(upload(served, b"nul\x00name.jsonl", jsonl([line("a")])), "file", "NUL")
    # lines whose ids hold a NUL: the line's error, as `pipeline submit` reports it
    done = upload(served, b"ids.jsonl", jsonl([line("a"), line("nul\u0000x"), line("b")]))
    refused(done, "line 2", "line 2: custom_id contains a NUL")
    assert "line 1" not in done.json()["error"]["message"] and "line 3" not in done.json()["error"]["message"]
    assert served.stored_files() == [] and served.count("files") == 0

    client = served.client()
    kept = client.files.create(file=("ok.jsonl", jsonl([line("a")])), purpose="batch")
    batch = {"input_file_id": kept.id, "endpoint": CHAT, "completion_window": "24h"}
    for change, param, says in [
            ({"input_file_id": "\ud800"}, "input_file_id", "unpaired surrogate"),   # was: 500
            ({"input_file_id": "file-\u0000"}, "input_file_id", "NUL"),
            ({"metadata": {"run": "nul\u0000"}}, "metadata", "NUL"),
            ({"metadata": {"nul\u0000": "run"}}, "metadata", "NUL"),
            ({"metadata": {"run": "\udc00"}}, "metadata", "unpaired surrogate"),
            ({"metadata": {"\ud800": "run"}}, "metadata", "unpaired surrogate"),
            ({"completion_window": "999999999999d"}, "completion_window", "at most 30 days")]:
        # the JSON escapes a client sends: json.dumps writes "\ud800" and "\u0000" as such
        done = httpx.post(f"{served.base_url}/batches", content=json.dumps({**batch, **change}), timeout=WAIT_S,
                          headers={**served.headers, "Content-Type": "application/json"})
        refused(done, param, says)
    with pytest.raises(openai.BadRequestError) as e:   # the same through the client
        client.batches.create(**batch, metadata={"run": "nul\u0000"})
    assert e.value.body["param"] == "metadata"
    refused(httpx.get(f"{served.base_url}/files", params={"purpose": "batch\u0000"}, headers=served.headers),
            "purpose", "NUL")
    assert served.count("jobs") == 0 and client.batches.list().data == []
    assert [f.id for f in client.files.list()] == [kept.id]


# --- connections that hold the server --------------------------------------------------------

@pytest.fixture
def timed_server(tmp_path):
    with serving(tmp_path, f"sqlite:///{tmp_path / 'ledger.sqlite'}") as server:
        yield server


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (what it sent before is read and dropped)."""
    while select.select([sock], [], [], 0)[0]:
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionError:
            return True
    return False


def trickle(sock: socket.socket, data: bytes, every_s: float = 0.05) -> int:
    """Send data a byte at a time until the server closes the connection; the bytes it took."""
    for sent, byte in enumerate(data):
        if closed_by_server(sock):
            return sent
        try:
            sock.send(bytes([byte]))
        except ConnectionError:
            return sent
        time.sleep(every_s)
    raise AssertionError(f"the server took all {len(data)} bytes, a byte every {every_s} s, and kept the connection")


def test_connections_that_send_nothing_or_trickle_are_closed(timed_server):
    server = timed_server
    address = ("127.0.0.1", server.port)
    # nothing sent at all: closed (was: open for ever)
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        assert sock.recv(1) == b""
    # a request head trickled: closed long before it is whole
    head = b"POST /v1/batches HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 1000 + b"\r\n\r\n"
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        assert trickle(sock, head) < len(head)
    # a whole head, then its body trickled (was: each byte within 30 s kept it open)
    head = (f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        sock.sendall(head)
        assert trickle(sock, b" " * 1000) < 1000
    # answered without reading the body (a wrong key: 401), whose rest goes on trickling
    head = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n")
    with socket.create_connection(address, timeout=WAIT_S) as sock:
        sock.sendall(head)
        assert sock.recv(12) == b"HTTP/1.1 401"
        assert trickle(sock, b" " * 1000) < 1000

    # What a client means to send still arrives: a slow but steady upload (16 KiB a second,
    # over several body windows) and the client's own requests on a kept-alive connection.
    rows = jsonl([line(f"slow-{i:04d}") for i in range(1000)])
    form = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n' + rows
            + b"\r\n--b--\r\n")

    def steadily():
        for start in range(0, len(form), 8192):
            yield form[start:start + 8192]
            time.sleep(0.5)

    assert len(form) > 3 * BODY_TIMEOUT_S * 16 * 1024   # it outlasts three windows
    done = httpx.post(f"{server.base_url}/files", content=steadily(), timeout=WAIT_S,
                      headers={**server.headers, "Content-Type": "multipart/form-data; boundary=b"})
    assert done.status_code == 200 and done.json()["bytes"] == len(rows), done.text
    client = server.client()
    assert client.files.retrieve(done.json()["id"]).filename == "slow.jsonl"
    assert [f.id for f in client.files.list()] == [done.json()["id"]]
