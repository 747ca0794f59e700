"""reasoning_effort in input lines: taken on chat lines of both formats (and Parquet rows), refused
where no chat template reads it, kept in the shard line and so in the answer key."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from input_files import COMPLETIONS, batch_line, chat_body, errors_by_line, specs, write
from jobs.reuse.answer_key import request_key

ASK = [{"role": "user", "content": "hi"}]


def test_chat_lines_take_reasoning_effort_in_both_formats(tmp_path):
    ours = specs(write(tmp_path, [
        {"id": "a", "messages": ASK, "reasoning_effort": "none"},
        {"id": "b", "messages": ASK, "reasoning_effort": "high", "temperature": 0},
        {"id": "c", "messages": ASK, "reasoning_effort": None},
        {"id": "d", "messages": ASK},
    ]))
    assert [s.reasoning_effort for s in ours] == ["none", "high", None, None]
    assert ours[0].to_dict()["reasoning_effort"] == "none" and "reasoning_effort" not in ours[3].to_dict()
    theirs = specs(write(tmp_path, [batch_line(f"x{i}", chat_body(reasoning_effort=effort))
                                    for i, effort in enumerate(("minimal", "low", "medium", "xhigh"))], "b.jsonl"))
    assert [s.reasoning_effort for s in theirs] == ["minimal", "low", "medium", "xhigh"]


def test_reasoning_effort_is_refused_where_no_chat_template_reads_it(tmp_path):
    bad = errors_by_line(write(tmp_path, [
        {"id": "a", "messages": ASK, "reasoning_effort": "extreme"},
        {"id": "b", "messages": ASK, "reasoning_effort": 1},
        {"id": "c", "prompt": "hi", "reasoning_effort": "low"},
    ]))
    assert bad[1].startswith("reasoning_effort must be one of 'none', 'minimal', 'low'") and "'extreme'" in bad[1]
    assert bad[2].startswith("reasoning_effort must be one of") and bad[2].endswith("got 1")
    assert bad[3] == "reasoning_effort needs messages (a chat request): it is given to the chat template"
    completions = errors_by_line(write(tmp_path, [batch_line("x", {"prompt": "hi", "reasoning_effort": "low"},
                                                             url=COMPLETIONS)], "c.jsonl"))
    assert completions == {1: "unsupported field 'reasoning_effort'"}


def test_a_parquet_column_of_reasoning_efforts_is_that_field(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "messages": [ASK, ASK], "reasoning_effort": ["none", None]}), path)
    assert [s.reasoning_effort for s in specs(str(path))] == ["none", None]


def test_another_reasoning_effort_is_another_answer(tmp_path):
    lines = [spec.to_dict() for spec in specs(write(tmp_path, [
        {"id": "a", "messages": ASK, "temperature": 0},
        {"id": "b", "messages": ASK, "temperature": 0, "reasoning_effort": "none"},
        {"id": "c", "messages": ASK, "temperature": 0, "reasoning_effort": "high"},
        {"id": "d", "messages": ASK, "temperature": 0, "reasoning_effort": "none"},
    ]))]
    keys = [request_key(line, "e" * 32) for line in lines]
    assert len({keys[0], keys[1], keys[2]}) == 3 and keys[1] == keys[3]
