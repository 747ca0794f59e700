"""`pipeline serve` before any batch runs: what it refuses to upload (bad lines, over the
size limit, cut short, doubled, fields or JSON bodies too large however they are sent, windows
out of range) keeps nothing, and what a killed server left is swept at start-up.

A real server process on a SQLite ledger, the real `openai` client and raw httpx; no worker:
nothing here runs a batch (batches that run: test_api_batches.py).
"""
from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest

from api_helpers import BAD_ROWS, CHAT, MAX_UPLOAD, batch_line, jsonl, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory, bundled_model_dir):
    with serving(tmp_path_factory.mktemp("api-uploads"), with_worker=False) as s:
        yield s


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
