"""`pipeline results`: exports as our JSONL or OpenAI's output and error files, to new
directories, never through a planted link nor onto a device, one file never both, an
existing one replaced only with --force."""
from __future__ import annotations

import contextlib
import json
import os
import stat

from cli import main
from cli_helpers import requests


def test_results_export(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    out = tmp_path / "out.jsonl"
    result = runner.invoke(main, ["results", job_id, "--export", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in requests())
    result = runner.invoke(main, ["results", job_id, "--format", "openai", "--output-file", str(tmp_path / "ok.jsonl"),
                                  "--error-file", str(tmp_path / "err.jsonl")])
    assert result.exit_code == 0, result.output
    ok = [json.loads(line)["custom_id"] for line in (tmp_path / "ok.jsonl").read_text().splitlines()]
    err = [json.loads(line)["custom_id"] for line in (tmp_path / "err.jsonl").read_text().splitlines()]
    assert len(ok) == 4 and err == ["too-long"]


def export(runner, job_id, *args):
    return runner.invoke(main, ["results", job_id, *map(str, args)])


def exported_ids(path):
    return sorted(json.loads(line).get("custom_id") or json.loads(line)["id"] for line in path.read_text().splitlines())


def test_export_makes_missing_directories_and_reports_unwritable_ones(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    out = tmp_path / "new" / "dir" / "out.jsonl"
    assert export(runner, job_id, "--export", out).exit_code == 0
    assert exported_ids(out) == sorted(r["id"] for r in requests())
    ok = tmp_path / "other" / "ok.jsonl"
    assert export(runner, job_id, "--format", "openai", "--output-file", ok).exit_code == 0
    assert len(exported_ids(ok)) == 4 and exported_ids(ok.with_name("ok.errors.jsonl")) == ["too-long"]
    (tmp_path / "a-file").write_text("")
    result = export(runner, job_id, "--export", tmp_path / "a-file" / "out.jsonl")
    assert result.exit_code == 1 and "the export could not be written" in result.stderr, result.output
    assert isinstance(result.exception, SystemExit)  # a clear error, not a traceback


def test_export_never_follows_a_planted_link_nor_replaces_a_device(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out.jsonl"
    planted = [tmp_path / ".out.jsonl.tmp", tmp_path / "out.jsonl.tmp"]  # the names a fixed temp file had
    for link in planted:
        link.symlink_to(victim)
    assert export(runner, job_id, "--export", out).exit_code == 0
    assert victim.read_text() == "precious" and all(link.is_symlink() for link in planted)
    assert exported_ids(out) == sorted(r["id"] for r in requests())
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == sorted(p.name for p in planted)
    # A target that is not a regular file is refused, with or without --force.
    fifo = tmp_path / "target.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.jsonl"
    link.symlink_to(victim)
    targets = [(fifo, "a FIFO (named pipe)"), (link, "a symbolic link")]
    with contextlib.suppress(PermissionError):  # a character device like /dev/full, where root may make one
        os.mknod(tmp_path / "full", 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        targets.append((tmp_path / "full", "a character device"))
    for target, kind in targets:
        for force in ([], ["--force"]):
            result = export(runner, job_id, "--export", target, *force)
            assert result.exit_code == 2 and f"is {kind}, not a regular file" in result.stderr, result.output
            result = export(runner, job_id, "--format", "openai", "--output-file", tmp_path / "ok.jsonl",
                            "--error-file", target, *force)
            assert result.exit_code == 2 and "nothing was written" in result.stderr, result.output
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink() and victim.read_text() == "precious"
    assert not (tmp_path / "ok.jsonl").exists()  # refused up front: not even the output file


def test_export_refuses_one_file_for_output_and_errors(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    tmp_path = tmp_path / "exports"
    (tmp_path / "d").mkdir(parents=True)
    for out, err in ((tmp_path / "x.jsonl", tmp_path / "x.jsonl"),
                     (tmp_path / "d" / ".." / "x.jsonl", tmp_path / "x.jsonl")):
        result = export(runner, job_id, "--format", "openai", "--output-file", out, "--error-file", err)
        assert result.exit_code == 2 and "are the same file" in result.stderr, result.output
    result = export(runner, job_id, "--format", "openai", "--export", tmp_path / "x.jsonl",
                    "--error-file", tmp_path / "x.jsonl", "--force")
    assert result.exit_code == 2 and "are the same file" in result.stderr
    result = export(runner, job_id, "--export", tmp_path / "x.jsonl", "--error-file", tmp_path / "e.jsonl")
    assert result.exit_code == 2 and "--error-file is for --format openai" in result.stderr  # not silently ignored
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_export_replaces_an_existing_file_only_with_force(runner, finished_job, tmp_path):
    job_id, _ = finished_job
    out, ok, err = tmp_path / "out.jsonl", tmp_path / "ok.jsonl", tmp_path / "err.jsonl"
    for path in (out, err):
        path.write_text("old\n")
    openai = ["--format", "openai", "--output-file", ok, "--error-file", err]
    for args in (["--export", out], openai):
        result = export(runner, job_id, *args)
        assert result.exit_code == 2 and "already exists: nothing was written (add --force" in result.stderr
    assert out.read_text() == err.read_text() == "old\n" and not ok.exists()
    assert export(runner, job_id, "--export", out, "--force").exit_code == 0
    assert export(runner, job_id, *openai, "--force").exit_code == 0
    assert exported_ids(out) == sorted(r["id"] for r in requests()) and exported_ids(err) == ["too-long"]
    assert "--force" in runner.invoke(main, ["results", "--help"]).stdout
