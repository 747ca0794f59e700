"""Batch invariance in a job's record: the engine key names the mode (answers computed
without it are not served to a job that has it) and `pipeline status` says which mode the
job ran in; an engine on CUDA refuses the mode rather than promise it."""
from __future__ import annotations

import pytest
import torch

from jobs.submission import create_job_from_file
from pipeline.engine_key import engine_key, identity, ran_batch_invariant
from pipeline.layers.batch_invariant import check_device
from cli import main
from cli_helpers import requests
from cluster import write_jsonl


def test_the_engine_key_names_the_mode_and_keeps_the_old_key_for_answers_computed_without_it():
    assert engine_key({}) != engine_key({"batch_invariant": False})
    assert "batch_invariant" not in identity({"batch_invariant": False})   # the key jobs had before the mode
    assert engine_key({"batch_invariant": True}) == engine_key({})         # on by default
    assert ran_batch_invariant({}, engine_key({}))
    assert not ran_batch_invariant({"batch_invariant": False}, engine_key({"batch_invariant": False}))
    # A job recorded before the mode existed: options without it, the key computed without it.
    assert not ran_batch_invariant({}, engine_key({"batch_invariant": False}))


@pytest.mark.parametrize("options, shown", [({}, "on: greedy and seeded answers"),
                                            ({"batch_invariant": False}, "off: an answer may differ")])
def test_status_says_which_mode_the_job_ran_in(runner, data_root, tmp_path, Session, options, shown):
    src = write_jsonl(tmp_path / "in.jsonl", requests())
    job_id, _ = create_job_from_file(Session, data_root, src, model="m", engine_options=options, shard_size=2)
    result = runner.invoke(main, ["status", job_id])
    assert result.exit_code == 0, result.output
    assert shown in " ".join(result.stdout.split()), result.stdout


def test_cuda_refuses_the_mode_with_what_to_do():
    with pytest.raises(ValueError, match="--no-batch-invariance"):
        check_device(torch.device("cuda"))
    check_device(torch.device("cpu"))
