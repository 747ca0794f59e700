"""Bad OpenAI batch lines: each refused with its line number and what is wrong, by `pipeline
run` and `pipeline submit` (in process, and as a real process on each ledger backend), and
nothing created: no job row, no job directory, nothing queued."""
from __future__ import annotations

import re

import pytest

from jobs.ledger import list_jobs, make_engine, session_factory
from jobs.paths import default_database_url
from worker_process import BROKER_URL, drop_queue, queued_messages
from cli import main
from openai_batch_helpers import CHAT, COMPLETIONS, FAST, QUEUE, cli, openai_line, pipeline_env, write_jsonl


@pytest.fixture(scope="module", autouse=True)
def queue_dropped_at_end():
    yield
    drop_queue(QUEUE)


# ---- bad batch lines -----------------------------------------------------------------------------

GOOD = openai_line("a", CHAT, {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})


def bad(custom_id, **changes):
    line = {**GOOD, "custom_id": custom_id, **changes}
    return {k: v for k, v in line.items() if v is not ...}


def bad_body(custom_id, **changes):
    return bad(custom_id, body={**GOOD["body"], **changes})


# (line, what the message must say) after GOOD on line 1
BAD_LINES = {
    "wrong method": (bad("m", method="GET"), "method must be \"POST\""),
    "unknown url": (bad("u", url="/v1/moderations"), "unknown url"),
    "missing body": (bad("b", body=...), "missing body"),
    "duplicate custom_id": (bad("a"), "duplicate id 'a' (first on line 1)"),
    "logprobs": (bad_body("l", logprobs=True, top_logprobs=21), "top_logprobs must be between 0 and 20"),
    "n=0": (bad_body("n", n=0), "n must be between 1 and 128, got 0"),
    "other url": (bad("o", url=COMPLETIONS, body={"prompt": "Hi"}), "every line of a batch must use the same url"),
    "other model": (bad_body("g", model="gpt-4o"), "model 'gpt-4o' is not the job's model"),
}


def assert_nothing_created(runner, data_root, db_url):
    assert not (data_root / "jobs").exists() or not any((data_root / "jobs").iterdir())
    engine = make_engine(db_url)
    try:
        with session_factory(engine)() as s:
            assert list_jobs(s) == []
    finally:
        engine.dispose()
    listing = runner.invoke(main, ["list"], env={"PIPELINE_DATABASE_URL": db_url})
    assert listing.exit_code == 0 and "no jobs yet" in listing.stdout, listing.output


@pytest.mark.parametrize("case", list(BAD_LINES))
@pytest.mark.parametrize("command", ["run", "submit"])
def test_each_bad_batch_line_exits_2_and_creates_nothing(runner, data_root, tmp_path, command, case):
    line, message = BAD_LINES[case]
    src = write_jsonl(tmp_path / "bad.jsonl", [GOOD, line, {**GOOD, "custom_id": "z"}])
    db_url = default_database_url(data_root)
    result = runner.invoke(main, [command, str(src), *FAST],
                           env={"PIPELINE_BROKER_URL": BROKER_URL, "PIPELINE_QUEUE": QUEUE})
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if re.match(r"\s*line \d+:", ln)]
    assert len(errors) == 1 and errors[0].strip().startswith("line 2:") and message in errors[0], result.stderr
    assert "1 error(s)" in result.stderr and "nothing was submitted" in result.stderr
    assert result.stdout == ""  # submit prints a job id on stdout only when it made one
    assert_nothing_created(runner, data_root, db_url)


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_file_of_bad_batch_lines_reports_every_line(data_root, db_url, tmp_path, command, runner):
    """A real `pipeline` process on each ledger backend: every bad line by number, exit 2,
    no job row, no job directory, nothing on this module's queue."""
    rows = [GOOD] + [line for line, _ in BAD_LINES.values()] + [{**GOOD, "custom_id": "z"}]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    env = pipeline_env(data_root, db_url)
    done = cli(env, command, src, *FAST, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    reported = {int(m[1]): m[2] for m in re.finditer(r"^\s*line (\d+): (.*)$", done.stderr, re.M)}
    assert sorted(reported) == list(range(2, 2 + len(BAD_LINES))), done.stderr
    for number, (_, message) in enumerate(BAD_LINES.values(), start=2):
        assert message in reported[number], (number, reported[number])
    assert f"{len(BAD_LINES)} error(s)" in done.stderr
    assert_nothing_created(runner, data_root, db_url)
    assert queued_messages(QUEUE) == 0
