"""`pipeline serve --model A --model B` (issue 53, item 4, through the API): each line's body.model
names one of the server's models (A by its served name, gpt-4o-mini; B as given or by its
directory's name), a batch is a job of the models its lines name, run by a real worker serving
both (real Redis, the openai client, one SQLite ledger)."""
from __future__ import annotations

import openai
import pyarrow.parquet as pq
import pytest
from openai.types import Batch, FileObject
from openai.types.chat import ChatCompletion
from sqlalchemy.orm import sessionmaker

from api_helpers import CHAT, jsonl, lines_of, raw, serving, wait_until_ended
from jobs.ledger import get_job, get_shards, make_engine
from jobs.paths import JobPaths


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir, other_tiny_model_dir):
    with serving(tmp_path_factory.mktemp("api-models"), with_worker=True, models=(tiny_model_dir, other_tiny_model_dir),
                 served_as=(f"gpt-4o-mini={tiny_model_dir.name}",)) as s:
        yield s


def _line(custom_id: str, model: str, max_tokens: int = 3) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": f"Say {custom_id}"}],
                     "max_tokens": max_tokens, "temperature": 0}}


def _upload(client, rows) -> FileObject:
    return FileObject.model_validate(raw(client.files.with_raw_response.create(
        file=("models.jsonl", jsonl(rows)), purpose="batch")))


def _run(server, rows) -> Batch:
    client = server.client()
    created = Batch.model_validate(raw(client.batches.with_raw_response.create(
        input_file_id=_upload(client, rows).id, endpoint=CHAT, completion_window="24h")))
    return wait_until_ended(client, created.id)


def _ledger(server, batch_id):
    Session = sessionmaker(make_engine(f"sqlite:///{server.root / 'ledger.sqlite'}"), expire_on_commit=False)
    with Session() as s:
        return get_job(s, batch_id), get_shards(s, batch_id)


def test_models_lists_each_model_by_its_served_names_else_its_directorys_name(server, other_tiny_model_dir):
    assert [m.id for m in server.client().models.list()] == ["gpt-4o-mini", other_tiny_model_dir.name]


def test_a_batch_naming_both_models_runs_each_line_on_its_own(server, tiny_model_dir, other_tiny_model_dir):
    a, b = "gpt-4o-mini", str(other_tiny_model_dir)   # by its served name; as the server was given it
    rows = [_line(f"r{i}", a if i % 2 == 0 else b) for i in range(5)]
    batch = _run(server, rows)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (5, 5)
    job, shards = _ledger(server, batch.id)
    assert [m["model"] for m in job.models] == [str(tiny_model_dir), str(other_tiny_model_dir)]
    assert job.models[0]["served_names"] == ["gpt-4o-mini"] and "served_names" not in job.models[1]
    assert job.model == str(tiny_model_dir) and batch.model == str(tiny_model_dir)   # its first model's
    fingerprints = [m["engine_fingerprint"] for m in job.models]
    assert len(set(fingerprints)) == 2 and [m["total_requests"] for m in job.models] == [3, 2]
    # each shard one model's lines, on that model's engine (shards of 2: A's 3 lines, then B's 2)
    assert [sh.engine_fingerprint for sh in shards] == [fingerprints[0]] * 2 + [fingerprints[1]]
    results = pq.read_table(JobPaths(server.root, job.id).results_dir).to_pylist()
    assert sorted(r["id"] for r in results) == [f"r{i}" for i in range(5)]   # every id exactly once
    for r in results:
        assert r["engine"] == fingerprints[int(r["id"][1:]) % 2], r
    out = lines_of(server.client(), batch.output_file_id)
    assert sorted(line["custom_id"] for line in out) == [f"r{i}" for i in range(5)]
    for line in out:   # each answer names its model as its line did
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.model == (a if int(line["custom_id"][1:]) % 2 == 0 else b)


def test_a_batch_of_one_of_the_models_is_a_one_model_job_of_it(server, other_tiny_model_dir):
    batch = _run(server, [_line(f"b{i}", other_tiny_model_dir.name) for i in range(3)])
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    job, shards = _ledger(server, batch.id)
    assert job.model == str(other_tiny_model_dir) and job.engine_options["model"] == str(other_tiny_model_dir)
    assert job.models is None and all(sh.engine_options is None for sh in shards)   # rows as a one-model job's
    results = pq.read_table(JobPaths(server.root, job.id).results_dir).to_pylist()
    assert {r["engine"] for r in results} == {job.engine_fingerprint}


def test_a_line_naming_no_model_or_another_is_refused_at_upload_with_its_line_number(server, tiny_model_dir):
    client = server.client()
    nameless = _line("n", "gpt-4o-mini")
    del nameless["body"]["model"]
    with pytest.raises(openai.BadRequestError) as refused:   # A, served as gpt-4o-mini, has that name only
        client.files.create(file=("bad.jsonl", jsonl([_line("ok", "gpt-4o-mini"), nameless, _line("x", "gpt-4o"),
                                                      _line("y", tiny_model_dir.name)])), purpose="batch")
    message = refused.value.message
    assert "line 2" in message and "names no model" in message, message
    assert "line 3" in message and "'gpt-4o'" in message, message
    assert "line 4" in message and repr(tiny_model_dir.name) in message and "line 1" not in message, message
