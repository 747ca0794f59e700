"""`pipeline serve` end to end: the real `openai` client against a real server process and a
real worker (Redis, the bundled model), on one SQLite ledger: batches of every endpoint run,
cancelled, reused and kept from other keys.

One server and one worker serve the whole module (the engine loads once). Raw responses are
validated with the openai package's types (the client itself only constructs them). The
uploads and limits the server enforces before any batch runs: test_api_uploads.py.
"""
from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Batch, FileDeleted, FileObject
from openai.types.chat import ChatCompletion
from sqlalchemy import text

from api_helpers import BAD_ROWS, CHAT, CHATS, batch_line, jsonl, lines_of, raw, serving, wait_until_ended
from jobs.ledger import make_engine
from cli import main
from polling import wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_model_dir):
    """The server and a worker, under tests/hold.py's hold (only "held-" requests are held)."""
    with serving(tmp_path_factory.mktemp("api"), with_worker=True, held=True) as s:
        yield s


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
    """The worker holds the running shard four tokens in (tests/hold.py) until the cancel
    reaches it, so none of its long lines can finish first, however fast the machine."""
    client = server.client()
    warm = [batch_line(f"warm-{i}", [{"role": "user", "content": "Hi"}], max_tokens=4) for i in range(2)]
    long = [batch_line(f"held-long-{i}", [{"role": "user", "content": "Tell me a story."}], max_tokens=200,
                       ignore_eos=True) for i in range(4)]   # (the KV cache of 0.1 GiB holds them)
    upload = client.files.create(file=("cancel.jsonl", jsonl(warm + long)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    wait_until("shard 0 (the warm lines) to be answered",
               lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2, timeout=120, poll_s=0.3)
    server.wait_held("held-long-")   # shard 1 mid-generation
    cancelling = Batch.model_validate(raw(client.batches.with_raw_response.cancel(batch.id)))
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait_until_ended(client, batch.id, timeout=60)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert batch.request_counts.completed == 2 and batch.request_counts.total == 6
    ok = lines_of(client, batch.output_file_id)
    assert sorted(line["custom_id"] for line in ok) == ["warm-0", "warm-1"]
    for line in lines_of(client, batch.error_file_id):   # the held shard's (and any never run)
        assert line["custom_id"].startswith("held-long-") and line["error"]["code"] == "batch_cancelled"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(finished[2].id)   # a completed batch cannot be cancelled

    # Pagination: one batch a page, newest first, the client following after=last_id.
    first = client.batches.list(limit=1)
    assert [b.id for b in first.data] == [batch.id] and first.has_more
    assert [b.id for b in client.batches.list(limit=1)] == [batch.id, finished[2].id]


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

