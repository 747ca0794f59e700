"""`pipeline run` and `--dry-run` of a Parquet table: the same shards, figures and answers as
the JSONL file whose lines its rows stand for; a column that is not there is refused at once."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from cli import main
from cli_helpers import FAST, requests
from cluster import write_jsonl

_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_COMPARED = ["id", "line", "choice", "output", "finish_reason", "error", "prompt_tokens", "output_tokens",
             "request_key"]


def as_table(rows: list[dict]) -> pa.Table:
    """The rows as a table: the prompt in a column of another name, chat messages as structs,
    a null wherever a line leaves a field out, in row groups of 2, and a column of our own."""
    def column(name):
        return [row.get(name) for row in rows]

    return pa.table({"id": column("id"), "question": column("prompt"),
                     "messages": pa.array(column("messages"), _MESSAGES), "max_tokens": column("max_tokens"),
                     "temperature": pa.array(column("temperature"), pa.float64()), "seed": column("seed"),
                     "source": ["the table's own column"] * len(rows)})


def run(runner, data_root, path, *options) -> tuple[str, pa.Table]:
    result = runner.invoke(main, ["run", str(path), *options])
    assert result.exit_code == 0, result.output
    job_id = re.search(r"job (job_\w+): 5 requests", result.stderr)[1]
    return job_id, read_results(JobPaths(data_root, job_id).results_dir).select(_COMPARED).sort_by("id")


def test_a_parquet_table_runs_as_its_jsonl_file_does(runner, data_root, tiny_model_dir, tmp_path):
    rows = requests()   # prompts greedy, a seeded chat, one prompt too long for the tiny model
    jsonl = write_jsonl(tmp_path / "in.jsonl", rows)
    table = tmp_path / "in.parquet"
    pq.write_table(as_table(rows), table, row_group_size=2)
    model = ["--model", str(tiny_model_dir), *FAST]
    columns = ["--prompt-column", "question"]

    missing = runner.invoke(main, ["run", str(table), "--prompt-column", "prompt", *model])
    assert missing.exit_code == 2 and "--prompt-column 'prompt' is not a column of the file" in missing.stderr
    assert "the file's columns are id: string, question: string, messages: list<" in missing.stderr
    assert not (data_root / "jobs").exists()

    dry = [runner.invoke(main, ["submit", str(path), "--dry-run", "--json", *model, *options])
           for path, options in ((jsonl, []), (table, columns))]
    assert [d.exit_code for d in dry] == [0, 0], [d.output for d in dry]
    assert json.loads(dry[0].stdout) == json.loads(dry[1].stdout)

    from_jsonl, expected = run(runner, data_root, jsonl, *model, "--no-reuse")
    from_table, answers = run(runner, data_root, table, *model, *columns, "--no-reuse")
    assert answers.to_pylist() == expected.to_pylist() and len(answers) == 5
    assert any(answers.column("output").to_pylist())
    assert answers.column("finish_reason").to_pylist().count("error") == 1   # the one too long
    jsonl_shards, table_shards = ([p.read_bytes() for p in sorted(JobPaths(data_root, job).input_dir.iterdir())]
                                  for job in (from_jsonl, from_table))
    assert table_shards == jsonl_shards
