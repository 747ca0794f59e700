"""The dry run's duration estimate (jobs.duration_estimate): how long answers are expected to run,
the job's steps laid out as continuous batching runs them, the engine's step costs
measured where the job's engine is built here, history's throughput elsewhere. How close
it comes to real runs is measured by benchmarks/dry_run_estimate.py, not here: these
check the arithmetic and what each kind of dry run reports."""
from __future__ import annotations

import json

import pytest

from jobs.duration_estimate import AnswerLengths, StepCosts, Work
from jobs.ledger import list_jobs
from jobs.paths import JobPaths
from jobs.results.parquet_files import read_results
from cli import main
from cluster import write_jsonl


def test_answers_are_expected_as_long_as_those_that_ended_by_themselves_or_their_cap():
    lengths = AnswerLengths(ended=[10, 20, 30], capped=1)   # one reached its own cap: it might have gone on
    assert lengths.count == 4
    assert lengths.expected(25) == (10 + 20 + 25 + 25) / 4
    assert lengths.expected(5) == 5 and lengths.expected(1000) == (10 + 20 + 30 + 1000) / 4
    assert AnswerLengths(ended=[], capped=0).expected(64) == 64   # no history: the ceiling
    # laid out over shares of 0..1, as long as those: the capped one as long as its cap
    assert [lengths.at(share, 25) for share in (0.0, 0.3, 0.5, 0.9)] == [10, 20, 25, 25]
    assert AnswerLengths(ended=[], capped=0).at(0.2, 64) == 64


def test_the_jobs_steps_are_its_answers_laid_out_on_the_engines_slots():
    def costs(slots: int, batch_tokens: int = 1024) -> StepCosts:
        return StepCosts(per_step=0.02, per_token=0.001, per_context_token=0.0, per_prompt_token=0.0005,
                         slots=slots, batch_tokens=batch_tokens)

    work = Work()
    work.add([(10, 30, 1)] * 4 + [(6, 0, 0)])   # four answers of 30 tokens (prompts of 10), an embedding of 6
    no_history = AnswerLengths([], 0)
    # two slots: two rounds of 30 steps; 120 tokens decoded, 46 prompt tokens computed
    assert work.seconds(costs(2), no_history) == pytest.approx(60 * 0.02 + 120 * 0.001 + 46 * 0.0005)
    # all four at once: 30 steps
    assert work.seconds(costs(64), no_history) == pytest.approx(30 * 0.02 + 120 * 0.001 + 46 * 0.0005)
    # a step holds at most max_num_batched_tokens: 166 tokens in steps of 4 take 41.5 steps
    assert work.seconds(costs(64, 4), no_history) == pytest.approx(41.5 * 0.02 + 120 * 0.001 + 46 * 0.0005)
    # answers expected to end after 10 tokens take a third of the steps and tokens
    short = AnswerLengths(ended=[10] * 9, capped=0)
    assert work.expected_output_tokens(short) == 40
    assert work.seconds(costs(64), short) == pytest.approx(10 * 0.02 + 40 * 0.001 + 46 * 0.0005)
    # a job waits for its longest answer: one in ten of history's ran to 100 tokens
    ten = Work()
    ten.add([(1, 100, 1)] * 10)
    mostly_short = AnswerLengths(ended=[1] * 9 + [100], capped=0)
    assert ten.seconds(costs(64), mostly_short) == pytest.approx(100 * 0.02 + 109 * 0.001 + 10 * 0.0005)
    # attention reads each answer's context at each of its steps: prompt plus the answer so far
    one = Work()
    one.add([(10, 4, 1)])
    with_context = StepCosts(per_step=0, per_token=0, per_context_token=0.5, per_prompt_token=0, slots=1,
                             batch_tokens=1024)
    assert one.seconds(with_context, no_history) == pytest.approx(4 * (10 + 4 / 2) * 0.5)


def test_pipeline_run_times_its_engine_and_expects_answers_as_long_as_the_engines_last_ones(
        runner, data_root, tmp_path, tiny_model_dir, Session):
    """Answers constrained to "yes" or "no" end after a token or two, far below max_tokens
    50: once a job of them ran, the next dry run expects that, not the ceiling."""
    lines = [{"id": f"q{i}", "prompt": f"Is {i} even?", "max_tokens": 50, "temperature": 0,
              "structured_outputs": {"choice": ["yes", "no"]}} for i in range(8)]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    engine = ["--model", str(tiny_model_dir), "--device", "cpu", "--kv-cache-gib", "0.05"]

    def dry(verb: str) -> dict:
        done = runner.invoke(main, [verb, str(src), *engine, "--dry-run", "--json", "--no-reuse"])
        assert done.exit_code == 0, done.output
        return json.loads(done.stdout)

    first = dry("run")
    assert (first["estimate_basis"], first["history_answers"]) == ("measured here", 0)
    assert first["expected_output_tokens"] == first["output_token_ceiling"] == 400 and first["estimated_s"] > 0
    assert dry("submit")["estimated_s"] is None   # the workers' engines: no history, no estimate

    assert runner.invoke(main, ["run", str(src), *engine]).exit_code == 0
    with Session() as s:
        (job,) = list_jobs(s)
    rows = read_results(JobPaths(data_root, job.id).results_dir).to_pylist()
    assert {r["finish_reason"] for r in rows} == {"stop"} and all(r["output_tokens"] < 50 for r in rows)
    answered = sum(r["output_tokens"] for r in rows)

    after = dry("run")
    assert (after["estimate_basis"], after["history_answers"]) == ("measured here", 8)
    assert after["expected_output_tokens"] == answered   # each expected at the mean of theirs
    submitted = dry("submit")
    assert submitted["estimate_basis"] == "history"
    assert submitted["estimated_s"] == pytest.approx((submitted["prompt_tokens"] + answered) / job.total_tok_s)
    text = runner.invoke(main, ["run", str(src), *engine, "--dry-run", "--no-reuse"]).stdout
    assert f"about {answered:,} to compute (answers' lengths as in the last 8 of the engine's)" in text
    assert "(the engine's steps timed here; the expected output; the model's load not counted)" in text
