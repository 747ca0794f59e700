"""Retention through `pipeline serve`: `expires_after` on an upload and `output_expires_after`
on a batch, as the openai client sends them; a file or a batch's output past its window answers
404, and the recovery pass (`pipeline recover`) deletes the bytes and the results; bad values
are 400s. A real server on a SQLite ledger (api_helpers), no worker: the batch is cancelled
before it runs, so its error file (batch_cancelled lines) is its output. The ledger's steps on
SQLite and PostgreSQL: the last test."""
from __future__ import annotations

import json
from datetime import timedelta

import openai
import pytest
from click.testing import CliRunner
from sqlalchemy import update

from api_helpers import CHAT, batch_line, jsonl, raw, serving, wait_until_ended
from cli import main
from jobs.ledger import File, Job, get_job, make_engine, session_factory, utcnow
from jobs.paths import JobPaths, default_database_url

HOUR, DAYS_30 = 3600, 2592000


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_model_dir):
    with serving(tmp_path_factory.mktemp("api-retention"), with_worker=False) as s:
        yield s


def sessions(server):
    return session_factory(make_engine(default_database_url(server.root)))


def lines(n=2):
    return jsonl([batch_line(f"r{i}", [{"role": "user", "content": "Hi"}], max_tokens=2) for i in range(n)])


def test_an_upload_and_a_batch_output_expire_to_404_and_the_sweep_deletes_them(server):
    client = server.client()
    upload = client.files.create(file=("keep.jsonl", lines()), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": HOUR})
    assert upload.expires_at == upload.created_at + HOUR
    assert client.files.retrieve(upload.id).expires_at == upload.expires_at
    forever = client.files.create(file=("forever.jsonl", lines()), purpose="batch")
    assert forever.expires_at is None

    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
    client.batches.cancel(batch.id)   # no worker: nothing ran, every line is a batch_cancelled error
    batch = wait_until_ended(client, batch.id, timeout=60)
    assert batch.status == "cancelled" and batch.error_file_id and batch.output_file_id is None
    error_file = client.files.retrieve(batch.error_file_id)
    Session = sessions(server)
    with Session() as s:
        job = get_job(s, batch.id)
        assert job.keep_seconds == 2 * HOUR
        assert error_file.expires_at == int(job.finished_at.timestamp()) + 2 * HOUR
    assert len(client.files.content(batch.error_file_id).text.splitlines()) == 2

    # Three hours pass (for the upload, the batch's end and its output file).
    with Session() as s:
        back = timedelta(hours=3)
        s.execute(update(Job).where(Job.id == batch.id).values(finished_at=job.finished_at - back))
        s.execute(update(File).where(File.id.in_([upload.id, error_file.id])).values(
            expires_at=utcnow() - timedelta(seconds=1)))
        s.commit()
    # Past its window a file is gone to the API at once, before the sweep deletes it.
    for file_id in (upload.id, error_file.id):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
    listed = {f.id for f in client.files.list()}
    assert forever.id in listed and upload.id not in listed and error_file.id not in listed
    assert raw(client.batches.with_raw_response.retrieve(batch.id))["error_file_id"] is None
    assert f"{upload.id}.jsonl" in server.stored_files()

    swept = CliRunner().invoke(main, ["recover"], env=server.env)
    assert swept.exit_code == 0, swept.output
    report = json.loads(swept.stdout)
    assert report["results_expired"] == [batch.id] and report["files_expired"] == [upload.id], report
    assert server.stored_files().count(f"{forever.id}.jsonl") == 1
    assert f"{upload.id}.jsonl" not in server.stored_files()
    assert f"{error_file.id}.jsonl" not in server.stored_files()
    assert not JobPaths(server.root, batch.id).results_dir.exists()
    with Session() as s:
        assert get_job(s, batch.id).results_expired_at is not None
    assert client.batches.retrieve(batch.id).status == "cancelled"   # the batch itself stays
    with pytest.raises(openai.NotFoundError):
        client.files.content(error_file.id)
    assert client.files.content(forever.id).text   # what has no window stays


def test_bad_expiry_policies_are_400s_and_make_nothing(server):
    client = server.client()
    before = server.stored_files()
    for policy, param in (({"anchor": "created_at", "seconds": HOUR - 1}, "expires_after.seconds"),
                          ({"anchor": "created_at", "seconds": DAYS_30 + 1}, "expires_after.seconds"),
                          ({"anchor": "last_active_at", "seconds": HOUR}, "expires_after.anchor"),
                          ({"anchor": "created_at"}, "expires_after.seconds"),
                          ({"anchor": "created_at", "seconds": "1e4"}, "expires_after.seconds")):
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("x.jsonl", lines()), purpose="batch", expires_after=policy)
        assert e.value.body["param"] == param, (policy, e.value.body)
    assert server.stored_files() == before
    upload = client.files.create(file=("ok.jsonl", lines()), purpose="batch",
                                 expires_after={"anchor": "created_at", "seconds": DAYS_30})
    batches = {b.id for b in client.batches.list()}
    for policy in ({"anchor": "created_at", "seconds": HOUR - 1}, {"anchor": "created_at", "seconds": DAYS_30 + 1},
                   {"anchor": "last_active_at", "seconds": HOUR}, {"seconds": HOUR},
                   {"anchor": "created_at", "seconds": "7200"}, {"anchor": "created_at", "seconds": 7200.5}):
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after=policy)
        assert "output_expires_after" in (e.value.body["param"] or ""), (policy, e.value.body)
    assert {b.id for b in client.batches.list()} == batches


def test_the_ledger_steps_of_retention(ledger, data_root):
    """expire_results on each backend: a file past its expires_at, a job past its keep (and one
    within it, one kept for ever), each deleted once."""
    from jobs.ledger import add_file, create_job, get_file, list_files
    from jobs.paths import file_path, new_file_id, new_job_id
    from jobs.results.retention import expire_results

    _, Session = ledger
    now = utcnow()
    files = {}
    for name, expires_at in (("gone", now - timedelta(seconds=1)), ("later", now + timedelta(hours=1)),
                             ("never", None)):
        files[name] = new_file_id()
        path = file_path(data_root, files[name])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")
        with Session() as s:
            add_file(s, id=files[name], api_key_id=None, purpose="batch", filename=f"{name}.jsonl", bytes=3,
                     expires_at=expires_at)
    jobs = {}
    for name, keep in (("past", 60), ("within", 86400), ("forever", None)):
        jobs[name] = new_job_id()
        with Session() as s:
            create_job(s, job_id=jobs[name], model="m", engine_options={}, input_format="pipeline", endpoint=None,
                       input_path="/in", results_path="/out", shard_size=1, shard_sizes=[1], keep_seconds=keep)
            s.execute(update(Job).where(Job.id == jobs[name]).values(status="completed",
                                                                     finished_at=now - timedelta(minutes=5)))
            s.commit()
        JobPaths(data_root, jobs[name]).results_dir.mkdir(parents=True)
    with Session() as s:
        assert get_file(s, files["gone"]) is None and get_file(s, files["later"]) is not None
        assert {f.id for f in list_files(s, None)} == {files["later"], files["never"]}
    report = expire_results(Session, data_root)
    assert report == {"results_expired": [jobs["past"]], "files_expired": [files["gone"]]}
    assert not file_path(data_root, files["gone"]).exists() and file_path(data_root, files["later"]).exists()
    assert [JobPaths(data_root, j).results_dir.exists() for j in jobs.values()] == [False, True, True]
    with Session() as s:
        assert [get_job(s, j).results_expired_at is not None for j in jobs.values()] == [True, False, False]
    assert expire_results(Session, data_root) == {"results_expired": [], "files_expired": []}
    later = expire_results(Session, data_root, now=now + timedelta(days=2))
    assert later == {"results_expired": [jobs["within"]], "files_expired": [files["later"]]}
