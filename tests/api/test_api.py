"""`pipeline serve` end to end: the real `openai` client against a real server process and a
real worker (Redis, the bundled model), on one SQLite ledger.

One server and one worker serve the whole module (the engine loads once). Raw responses are
validated with the openai package's types (the client itself only constructs them).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import Batch, FileDeleted, FileObject
from openai.types.chat import ChatCompletion
from sqlalchemy import text

from jobs.ledger import make_engine
from cli import main
from worker_process import BROKER_URL, drop_queue, worker

CHAT = "/v1/chat/completions"
QUEUE = f"pipeline-test-api-{uuid.uuid4().hex[:8]}"
MAX_UPLOAD = 256 * 1024
ENDED = ("completed", "failed", "cancelled", "expired")
TOO_LONG = "word " * 10_000   # over the bundled model's 8192 positions: that request fails

CHATS = {
    "capital": [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}],
    "greet": [{"role": "user", "content": "Hello! Who are you?"}],
    "long": [{"role": "user", "content": TOO_LONG}],
}


def batch_line(custom_id, messages, **body):
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "SmolLM2-135M-Instruct", "messages": messages, "temperature": 0, **body}}


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, root, env, base_url, keys):
        self.root, self.env, self.base_url, self.keys = root, env, base_url, keys

    def client(self, key: str | None = None) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key or self.keys["team-a"], max_retries=0, timeout=60)

    def stored_files(self) -> list[str]:
        """Every name under <data root>/files (hidden temporary uploads too)."""
        files = self.root / "files"
        return sorted(p.name for p in files.iterdir()) if files.exists() else []


SERVED_AS = ["--served-model-name", "SmolLM2-135M-Instruct", "--served-model-name", "gpt-4o-mini"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_model_dir):
    tmp = tmp_path_factory.mktemp("api")
    root = tmp / "data"
    env = {**os.environ, "PIPELINE_DATA_DIR": str(root), "PIPELINE_BROKER_URL": BROKER_URL,
           "PIPELINE_QUEUE": QUEUE, "PIPELINE_SHARDS_IN_FLIGHT": "1", "PIPELINE_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    env.pop("PIPELINE_DATABASE_URL", None)   # the SQLite ledger in the data root
    from click.testing import CliRunner
    keys = {}
    for name, *shared in (("team-a",), ("team-b",), ("team-c",), ("team-d",), ("lab-1", "--share-answers", "lab"),
                          ("lab-2", "--share-answers", "lab")):
        done = CliRunner().invoke(main, ["keys", "add", name, *shared], env=env)
        assert done.exit_code == 0, done.output
        keys[name] = done.stdout.strip()
    port = free_port()
    log = open(tmp / "serve.log", "wb")
    # Lines may name the model as the bundled directory does, or as a hosted API's file would.
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port), "--shard-size", "2",
                             "--device", "cpu", "--kv-cache-gib", "0.1", *SERVED_AS], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "serve.log").read_text()
            try:
                ready = httpx.get(f"{base_url}/files", headers={"Authorization": f"Bearer {keys['team-a']}"})
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp / "serve.log").read_text()
            time.sleep(0.2)
        with worker(env, tmp / "worker.log", "--device", "cpu", "--kv-cache-gib", "0.1"):
            yield Server(root, env, base_url, keys)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        drop_queue(QUEUE)


def raw(response) -> dict:
    """The JSON a with_raw_response call got."""
    return json.loads(response.text)


def wait_until_ended(client: OpenAI, batch_id: str, timeout: float = 300) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = Batch.model_validate(raw(client.batches.with_raw_response.retrieve(batch_id)))
        if batch.status in ENDED:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def lines_of(client: OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(server):
    """A chat batch of team-a, uploaded, created and run to the end: (input file, batch)."""
    client = server.client()
    rows = [batch_line(cid, messages, max_tokens=16) for cid, messages in CHATS.items()]
    upload = FileObject.model_validate(raw(client.files.with_raw_response.create(
        file=("nightly.jsonl", jsonl(rows)), purpose="batch")))
    created = Batch.model_validate(raw(client.batches.with_raw_response.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h", metadata={"team": "a"})))
    return upload, created, wait_until_ended(client, created.id)


def test_a_chat_batch_runs_end_to_end_through_the_openai_client(server, finished):
    client = server.client()
    upload, created, batch = finished
    assert (upload.object, upload.purpose, upload.filename) == ("file", "batch", "nightly.jsonl")
    assert upload.bytes == len(jsonl([batch_line(c, m, max_tokens=16) for c, m in CHATS.items()]))
    assert (created.status, created.input_file_id, created.endpoint) == ("in_progress", upload.id, CHAT)
    assert created.output_file_id is None and created.metadata == {"team": "a"}
    assert batch.status == "completed" and batch.id == created.id
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
    assert batch.created_at <= batch.in_progress_at <= batch.completed_at
    assert batch.output_file_id and batch.error_file_id and batch.model == "SmolLM2-135M-Instruct"

    ok, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    assert sorted(line["custom_id"] for line in ok) == ["capital", "greet"]
    output_tokens = 0
    for line in ok:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.choices[0].message.role == "assistant" and body.choices[0].message.content
        output_tokens += body.usage.completion_tokens
        if line["custom_id"] == "capital":
            assert "Paris" in body.choices[0].message.content, body   # greedy, the bundled model
    assert batch.usage.output_tokens == output_tokens
    (error,) = errors
    assert error["custom_id"] == "long" and error["response"] is None
    assert error["error"]["code"] == "request_failed" and error["error"]["message"]

    output = FileObject.model_validate(raw(client.files.with_raw_response.retrieve(batch.output_file_id)))
    assert output.purpose == "batch_output" and output.bytes == len(client.files.content(output.id).content)
    listed = raw(client.files.with_raw_response.list())
    assert {f["id"] for f in listed["data"]} >= {upload.id, batch.output_file_id, batch.error_file_id}
    assert all(FileObject.model_validate(f) for f in listed["data"])
    assert batch.id in {b.id for b in client.batches.list()}
    # The same batch read twice: the output files are written once, their ids stay.
    again = client.batches.retrieve(batch.id)
    assert (again.output_file_id, again.error_file_id) == (batch.output_file_id, batch.error_file_id)

    # The ledger says which key made the job, for SQL users.
    engine = make_engine(f"sqlite:///{server.root / 'ledger.sqlite'}")
    with engine.connect() as conn:
        owner = conn.execute(text("SELECT k.name FROM jobs j JOIN api_keys k ON k.id = j.api_key_id "
                                  "WHERE j.id = :id"), {"id": batch.id}).scalar_one()
        hashes = conn.execute(text("SELECT key_sha256 FROM api_keys")).scalars().all()
    engine.dispose()
    assert owner == "team-a"
    assert server.keys["team-a"] not in hashes and len(hashes) == len(server.keys)   # only hashes are stored

    deleted = FileDeleted.model_validate(raw(client.files.with_raw_response.delete(batch.error_file_id)))
    assert deleted.deleted and f"{deleted.id}.jsonl" not in server.stored_files()
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.error_file_id)
    # Deleted stays deleted: the ended batch's files are written once, never again.
    client.files.delete(batch.output_file_id)
    again = Batch.model_validate(raw(client.batches.with_raw_response.retrieve(batch.id)))
    assert (again.output_file_id, again.error_file_id) == (None, None)
    assert not {f"{batch.output_file_id}.jsonl", f"{batch.error_file_id}.jsonl"} & set(server.stored_files())
    assert batch.output_file_id not in {f.id for f in client.files.list()}


def test_cancel_through_the_client_keeps_the_partial_results(server, finished):
    client = server.client()
    warm = [batch_line(f"warm-{i}", [{"role": "user", "content": "Hi"}], max_tokens=4) for i in range(2)]
    long = [batch_line(f"long-{i}", [{"role": "user", "content": "Tell me a story."}], max_tokens=3000,
                       ignore_eos=True) for i in range(4)]
    upload = client.files.create(file=("cancel.jsonl", jsonl(warm + long)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < 2:   # shard 0: the warm lines
        assert time.monotonic() < deadline
        time.sleep(0.3)
    cancelling = Batch.model_validate(raw(client.batches.with_raw_response.cancel(batch.id)))
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait_until_ended(client, batch.id, timeout=60)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed == 2 and batch.request_counts.total == 6
    ok = lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in ok) == ["warm-0", "warm-1"]
    for line in lines_of(client, batch.error_file_id):   # the shard that was running, if one was
        assert line["custom_id"].startswith("long-") and line["error"]["code"] == "batch_cancelled"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(finished[2].id)   # a completed batch cannot be cancelled

    # Pagination: one batch a page, newest first, the client following after=last_id.
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [batch.id] and first.has_more
    assert [b.id for b in client.batches.list(limit=1)] == [batch.id, finished[2].id]


BAD_ROWS = [batch_line("a", [{"role": "user", "content": "Hi"}]),
            {**batch_line("b", [{"role": "user", "content": "Hi"}]), "method": "GET"},
            batch_line("c", [{"role": "user", "content": "Hi"}], n=129),
            batch_line("d", [{"role": "user", "content": "Hi"}], model="gpt-4o")]


def test_a_bad_upload_returns_the_line_numbered_errors_and_keeps_nothing(server):
    client = server.client()
    before, files_before = server.stored_files(), {f.id for f in client.files.list()}
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", jsonl(BAD_ROWS)), purpose="batch")
    error = e.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    message = error["message"]
    assert message.startswith("bad.jsonl: 3 error(s), nothing was uploaded")
    reported = [line.split(":")[0] for line in message.splitlines()[1:]]
    assert reported == ["line 2", "line 3", "line 4"], message
    assert 'method must be "POST"' in message and "n must be between 1 and 128, got 129" in message
    assert "model 'gpt-4o' is not a name of the job's model" in message
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("ok.jsonl", jsonl(BAD_ROWS[:1])), purpose="fine-tune")
    assert server.stored_files() == before and {f.id for f in client.files.list()} == files_before


def test_models_lists_the_served_model_for_the_openai_client(server):
    client = server.client()
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct", "gpt-4o-mini"]
    assert client.models.retrieve("gpt-4o-mini").object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_an_unchanged_hosted_batch_file_runs_with_n_choices_through_the_client(server):
    """Every line names gpt-4o-mini, as a hosted API's file does; one asks for 3 choices."""
    client = server.client()
    rows = [batch_line("capital", CHATS["capital"], max_tokens=8, n=3, model="gpt-4o-mini"),
            batch_line("greet", CHATS["greet"], max_tokens=8, model="gpt-4o-mini")]
    upload = client.files.create(file=("hosted.jsonl", jsonl(rows)), purpose="batch")
    batch = wait_until_ended(client, client.batches.create(input_file_id=upload.id, endpoint=CHAT,
                                                           completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 2 and not batch.error_file_id
    lines = {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"])
             for line in lines_of(client, batch.output_file_id)}
    assert {body.model for body in lines.values()} == {"gpt-4o-mini"}
    capital = lines["capital"]
    assert [c.index for c in capital.choices] == [0, 1, 2]
    assert all("Paris" in c.message.content for c in capital.choices)   # greedy: three times the same
    assert batch.usage.output_tokens == sum(b.usage.completion_tokens for b in lines.values())


def test_an_embeddings_batch_runs_through_the_client_and_a_chat_file_is_refused_for_it(server):
    """/v1/embeddings lines on the bundled decoder (last-token pooling, normalised): a text, a
    list of texts, token ids; floats and base64 (the same vector), dimensions cut it."""
    import base64
    import struct

    from openai.types import CreateEmbeddingResponse
    client = server.client()
    url = "/v1/embeddings"
    rows = [{"custom_id": cid, "method": "POST", "url": url, "body": {"model": "gpt-4o-mini", **body}} for cid, body in [
        ("one", {"input": "the cat sat on the mat"}),
        ("many", {"input": ["the cat sat on the mat", "quarterly revenue grew 8%"]}),
        ("b64", {"input": "the cat sat on the mat", "encoding_format": "base64", "dimensions": 64}),
        ("ids", {"input": [[1, 2, 3]]}),
    ]]
    upload = client.files.create(file=("corpus.jsonl", jsonl(rows)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="are for /v1/embeddings, not /v1/chat/completions"):
        client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    batch = wait_until_ended(client, client.batches.create(input_file_id=upload.id, endpoint=url,
                                                           completion_window="24h").id)
    assert batch.status == "completed" and batch.endpoint == url and batch.request_counts.completed == 4
    lines = {line["custom_id"]: line["response"]["body"] for line in lines_of(client, batch.output_file_id)}
    raw64 = lines["b64"]["data"][0]["embedding"]
    cut = list(struct.unpack("<64f", base64.b64decode(raw64)))
    lines["b64"]["data"][0]["embedding"] = cut   # the type holds floats (the client decodes base64 itself)
    bodies = {cid: CreateEmbeddingResponse.model_validate(body) for cid, body in lines.items()}
    one, many = bodies["one"].data[0].embedding, bodies["many"].data
    assert len(one) == 576 and abs(sum(x * x for x in one) - 1) < 1e-4 and bodies["one"].model == "gpt-4o-mini"
    assert [d.index for d in many] == [0, 1] and many[0].embedding == pytest.approx(one, abs=1e-5)
    norm = sum(x * x for x in one[:64]) ** 0.5
    assert cut == pytest.approx([x / norm for x in one[:64]], abs=1e-5)
    assert bodies["many"].usage.prompt_tokens > bodies["one"].usage.prompt_tokens > 0   # every input's tokens
    assert bodies["ids"].usage.prompt_tokens == 3


def test_a_responses_batch_runs_through_the_client_as_response_objects(server):
    """/v1/responses lines as a hosted batch file writes them (instructions, input, a model name
    the server is given), and a file of them is refused for a chat batch."""
    from openai.types.responses import Response
    client = server.client()
    url = "/v1/responses"
    rows = [{"custom_id": "capital", "method": "POST", "url": url, "body": {
        "model": "gpt-4o-mini", "instructions": "You answer in one word.", "input": "What is the capital of France?",
        "max_output_tokens": 8, "temperature": 0, "store": False}}]
    upload = client.files.create(file=("responses.jsonl", jsonl(rows)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match=f"are for {url}, not {CHAT}"):
        client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    batch = wait_until_ended(client, client.batches.create(input_file_id=upload.id, endpoint=url,
                                                           completion_window="24h").id)
    assert batch.status == "completed" and batch.endpoint == url and batch.request_counts.completed == 1
    (line,) = lines_of(client, batch.output_file_id)
    body = Response.model_validate(line["response"]["body"])
    assert line["custom_id"] == "capital" and body.model == "gpt-4o-mini" and "Paris" in body.output_text
    assert batch.usage.output_tokens == body.usage.output_tokens > 0


def test_a_rerun_of_an_answered_file_is_completed_when_it_is_created(server):
    """Reuse at submit through the API: the same lines again make a batch that is completed in
    the create call's own answer, its output lines the first batch's answers. (After the
    cancel test, which pages through every batch of team-a.)"""
    client = server.client()
    rows = [batch_line(cid, CHATS[cid], max_tokens=12) for cid in ("capital", "greet")]

    def create() -> Batch:
        upload = client.files.create(file=("rerun.jsonl", jsonl(rows)), purpose="batch")
        return Batch.model_validate(raw(client.batches.with_raw_response.create(
            input_file_id=upload.id, endpoint=CHAT, completion_window="24h")))

    first = wait_until_ended(client, create().id)
    again = create()
    assert first.status == again.status == "completed" and again.request_counts.completed == 2
    assert again.output_file_id and again.error_file_id is None

    def answers(batch):
        return {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"]).choices[0].message.content
                for line in lines_of(client, batch.output_file_id)}
    assert answers(again) == answers(first) and "Paris" in answers(again)["capital"]


def test_answers_are_reused_only_for_the_key_that_computed_them_or_keys_sharing_a_scope(server):
    """Another key's batch of the same prompts is computed afresh, in_progress when created like
    any batch (its create answer tells nothing of what other keys ran); two keys made with
    `--share-answers lab` reuse each other's."""
    rows = [batch_line("secret", [{"role": "user", "content": "Our confidential plan, in a word?"}], max_tokens=4)]

    def create(key: str) -> Batch:
        client = server.client(server.keys[key])
        upload = client.files.create(file=("secret.jsonl", jsonl(rows)), purpose="batch")
        return Batch.model_validate(raw(client.batches.with_raw_response.create(
            input_file_id=upload.id, endpoint=CHAT, completion_window="24h")))

    def reused(batch: Batch) -> int:
        engine = make_engine(f"sqlite:///{server.root / 'ledger.sqlite'}")
        with engine.connect() as conn:
            n = conn.execute(text("SELECT reused_requests FROM jobs WHERE id = :id"), {"id": batch.id}).scalar_one()
        engine.dispose()
        return n

    first = wait_until_ended(server.client(), create("team-a").id)
    assert first.status == "completed" and reused(first) == 0
    mine = create("team-a")
    assert mine.status == "completed" and reused(mine) == 1   # its own key: answered when created
    theirs = create("team-d")
    assert theirs.status == "in_progress"                       # as for a prompt nobody ran
    theirs = wait_until_ended(server.client(server.keys["team-d"]), theirs.id)
    assert theirs.status == "completed" and theirs.request_counts.completed == 1 and reused(theirs) == 0

    shared = wait_until_ended(server.client(server.keys["lab-1"]), create("lab-1").id)
    assert shared.status == "completed" and reused(shared) == 0      # the lab scope had none of team-a's
    from_lab = create("lab-2")
    assert from_lab.status == "completed" and reused(from_lab) == 1   # lab-1's answer, shared by choice


def test_another_key_gets_404_for_the_first_keys_batch_and_files(server, finished):
    upload, _, batch = finished
    other = server.client(server.keys["team-b"])
    for call in (lambda: other.batches.retrieve(batch.id), lambda: other.batches.cancel(batch.id),
                 lambda: other.files.retrieve(upload.id), lambda: other.files.content(upload.id),
                 lambda: other.files.content(batch.output_file_id), lambda: other.files.delete(upload.id),
                 lambda: other.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error" and "No such" in e.value.body["message"]
    assert list(other.batches.list()) == [] and list(other.files.list()) == []
    # The same answer as for an id that does not exist at all.
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve("job_0000000000000000")
    assert server.client().files.retrieve(upload.id).id == upload.id   # still there for its owner


def test_no_key_a_wrong_key_and_a_revoked_key_get_401(server, finished):
    from click.testing import CliRunner

    upload, _, batch = finished
    done = httpx.get(f"{server.base_url}/batches/{batch.id}")
    assert done.status_code == 401 and done.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/files", headers={"Authorization": "Basic abc"}).status_code == 401
    wrong = server.client("sk-pipeline-" + "x" * 43)
    for call in (wrong.files.list, wrong.batches.list, lambda: wrong.batches.retrieve(batch.id),
                 lambda: wrong.files.content(upload.id),
                 lambda: wrong.files.create(file=("x.jsonl", jsonl(BAD_ROWS[:1])), purpose="batch")):
        with pytest.raises(openai.AuthenticationError):
            call()
    revoked = server.client(server.keys["team-c"])
    assert list(revoked.files.list()) == []
    runner = CliRunner()
    done = runner.invoke(main, ["keys", "revoke", "team-c"], env=server.env)
    assert done.exit_code == 0 and "revoked" in done.stdout, done.output
    with pytest.raises(openai.AuthenticationError):
        revoked.files.list()
    listing = runner.invoke(main, ["keys", "list"], env=server.env).stdout
    assert "team-c" in listing and "revoked" in listing and server.keys["team-a"] not in listing
    assert runner.invoke(main, ["keys", "revoke", "team-c"], env=server.env).exit_code == 2
    assert runner.invoke(main, ["keys", "add", "team-a"], env=server.env).exit_code == 2   # names are unique


def test_an_upload_over_the_limit_is_refused_without_writing_a_file(server):
    client = server.client()
    before = server.stored_files()
    def lines(n):
        return "".join(json.dumps(batch_line(f"big-{i:04d}", [{"role": "user", "content": "x" * 1000}])) + "\n"
                       for i in range(n))

    size = len(lines(1))
    big = lines(2 * MAX_UPLOAD // size).encode()
    with pytest.raises(openai.APIStatusError) as e:   # refused from its Content-Length
        client.files.create(file=("big.jsonl", big), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
    assert server.stored_files() == before

    # Chunked, without a Content-Length: stopped once the file passes the limit.
    boundary = "pipeline-test-boundary"

    def body():
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
               f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
               "Content-Type: application/jsonl\r\n\r\n").encode()
        for start in range(0, len(big), 16384):
            yield big[start:start + 16384]
        yield f"\r\n--{boundary}--\r\n".encode()

    done = httpx.post(f"{server.base_url}/files", content=body(), timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['team-a']}",
                               "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert done.status_code == 413 and done.json()["error"]["code"] == "file_too_large", done.text
    assert server.stored_files() == before
    # Just under the limit is accepted (the limit is on the file, not the form around it).
    fits = lines(MAX_UPLOAD // size - 1)
    assert client.files.create(file=("fits.jsonl", fits.encode()), purpose="batch").bytes == len(fits)


# --- what a careless or hostile client sends ------------------------------------------------

def raw_upload(server, body: bytes, boundary: str = "pipeline-test-boundary", **headers) -> httpx.Response:
    return httpx.post(f"{server.base_url}/files", content=body, timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['team-a']}",
                               "Content-Type": f"multipart/form-data; boundary={boundary}", **headers})


def form(parts: list[tuple[str, str | None, bytes]], boundary: str = "pipeline-test-boundary", close=True) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + (f"--{boundary}--\r\n".encode() if close else b"")


def test_a_truncated_or_doubled_upload_is_refused_and_nothing_is_kept(server):
    before = server.stored_files()
    lines = jsonl([batch_line(f"t{i}", [{"role": "user", "content": "Hi"}]) for i in range(20)])
    cut = lines[:lines.index(b"\n", len(lines) // 2) + 1]   # cut at a line boundary: it would validate
    # no closing boundary
    done = raw_upload(server, form([("purpose", None, b"batch"), ("file", "cut.jsonl", cut)], close=False))
    assert done.status_code == 400 and done.json()["error"]["code"] == "incomplete_upload", done.text
    # a Content-Length shorter than the body: the server reads only that much
    whole = form([("purpose", None, b"batch"), ("file", "whole.jsonl", lines)])
    short = whole[:len(whole) - len(lines) // 2]
    done = raw_upload(server, short)
    assert done.status_code == 400 and done.json()["error"]["code"] == "incomplete_upload", done.text
    # two file parts
    done = raw_upload(server, form([("purpose", None, b"batch"), ("file", "a.jsonl", lines),
                                    ("file", "b.jsonl", lines)]))
    assert done.status_code == 400 and "more than one 'file' part" in done.json()["error"]["message"]
    assert server.stored_files() == before
    done = raw_upload(server, whole)   # the same form, whole, is taken with every line
    assert done.status_code == 200 and done.json()["bytes"] == len(lines), done.text


def test_form_fields_and_json_bodies_are_limited_however_they_are_sent(server):
    before = server.stored_files()

    def chunked_fields():   # many small fields, each under any per-field limit, no Content-Length
        yield form([("purpose", None, b"batch")], close=False)
        for i in range(2000):
            yield form([(f"x{i}", None, b"y" * 1000)], close=False)
        yield b"--pipeline-test-boundary--\r\n"

    done = httpx.post(f"{server.base_url}/files", content=chunked_fields(), timeout=60,
                      headers={"Authorization": f"Bearer {server.keys['team-a']}",
                               "Content-Type": "multipart/form-data; boundary=pipeline-test-boundary"})
    assert done.status_code in (400, 413), done.text
    assert done.json()["error"]["type"] == "invalid_request_error"
    assert server.stored_files() == before
    big = json.dumps({"input_file_id": "file-" + "0" * 24, "endpoint": CHAT, "completion_window": "24h",
                      "metadata": {"pad": "x" * (2 * 1024 * 1024)}}).encode()
    headers = {"Authorization": f"Bearer {server.keys['team-a']}", "Content-Type": "application/json"}
    done = httpx.post(f"{server.base_url}/batches", content=big, headers=headers, timeout=60)
    assert done.status_code == 413 and done.json()["error"]["code"] == "request_too_large", done.text
    done = httpx.post(f"{server.base_url}/batches", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                      headers=headers, timeout=60)
    assert done.status_code == 413 and done.json()["error"]["code"] == "request_too_large", done.text


def test_windows_out_of_range_and_deleted_inputs_are_client_errors_not_500s(server):
    client = server.client()
    upload = client.files.create(file=("w.jsonl", jsonl([batch_line("w", [{"role": "user", "content": "Hi"}])])),
                                 purpose="batch")
    for window in ("99999999999999999999h", "3000000d", "24h ", "\uff12\uff14h", "31d"):
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window=window)
        assert e.value.body["param"] == "completion_window", window
    client.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.files.content(upload.id)


def test_start_up_removes_what_a_killed_server_left_but_nothing_else(data_root, ledger):
    from api.files import sweep_leftovers
    from jobs.ledger import add_file
    from jobs.paths import file_path, files_dir, new_file_id

    _, Session = ledger
    files = files_dir(data_root)
    files.mkdir(parents=True)
    registered, orphan, fresh = new_file_id(), new_file_id(), new_file_id()
    with Session() as s:
        add_file(s, id=registered, api_key_id=None, purpose="batch", filename="kept.jsonl", bytes=1)
    old = time.time() - 7200
    for name in (registered, orphan, fresh):
        file_path(data_root, name).write_text("{}\n")
    tmp = files / f".{orphan}.jsonl.0123456789abcdef.tmp"
    tmp.write_text("half an upload")
    other = files / "README.txt"   # not ours: never touched
    other.write_text("hello")
    for path in (file_path(data_root, registered), file_path(data_root, orphan), tmp, other):
        os.utime(path, (old, old))
    assert sweep_leftovers(Session, data_root) == 2
    assert sorted(p.name for p in files.iterdir()) == sorted(
        ["README.txt", f"{registered}.jsonl", f"{fresh}.jsonl"])
