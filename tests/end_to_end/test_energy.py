"""Energy and cost per job, end to end on SQLite and PostgreSQL: `pipeline run` and a real worker
read a powercap-shaped directory (PIPELINE_POWERCAP_DIR) whose counters a thread advances at
100 W, wrapping, so every shard's joules are 100 W x its device-seconds; the job's figures are
its shards' sums, in the ledger, stats.parquet, `pipeline status` and the Prometheus counters.
Without a readable counter the joules are null and `pipeline status` says why; migration 0016
goes down and up."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from cli import main
from cli_helpers import FAST
from cluster import write_jsonl
from energy_helpers import Powercap
from jobs.ledger import get_job, get_shards, upgrade
from jobs.paths import JobPaths
from ledger_helpers import the_job_and_its_shards
from metrics_helpers import HOST, in_process
from workers.metrics import model_label

RATE = 3.6   # per hour: a device-second costs 0.001


@pytest.fixture(autouse=True)
def _energy_from_the_environment_after():
    """`pipeline run` in this process configures workers.energy with its settings: later tests read theirs."""
    yield
    from workers import energy
    energy.configure(None)


def _rows(n: int) -> list[dict]:
    return [{"id": f"e{i}", "prompt": f"Say something about {i}", "max_tokens": 24, "temperature": 0}
            for i in range(n)]


def _plain(text: str) -> str:
    return " ".join(text.split())


def _check_measured(job, shards, watts: float, data_root) -> None:
    ran = [sh for sh in shards if sh.device_seconds is not None]
    assert len(ran) == job.num_shards and all(sh.status == "completed" for sh in ran)
    for sh in ran:
        assert sh.energy_meter == "rapl (package-0, package-1)" and sh.energy_unmeasured is None
        # (one that commits just after another, their requests having ended in one step, gets a few ms)
        assert sh.joules >= 0 and sh.device_seconds >= 0
        assert sh.joules == pytest.approx(watts * sh.device_seconds, abs=watts * 0.05, rel=0.05)
        assert sh.cost == pytest.approx(sh.device_seconds * RATE / 3600)
    assert job.joules > 0 and job.joules == pytest.approx(sum(sh.joules for sh in ran))
    assert job.device_seconds == pytest.approx(sum(sh.device_seconds for sh in ran))
    assert job.cost == pytest.approx(job.device_seconds * RATE / 3600)
    assert job.tokens_per_joule == pytest.approx((job.prompt_tokens + job.output_tokens) / job.joules)  # none reused
    assert job.energy_unmeasured is None
    stats = pq.read_table(JobPaths(data_root, job.id).stats_file).to_pylist()[0]
    assert [stats[k] for k in ("joules", "tokens_per_joule", "device_seconds", "cost")] == pytest.approx(
        [job.joules, job.tokens_per_joule, job.device_seconds, job.cost])



def test_pipeline_run_measures_each_shard_from_the_rapl_counters(runner, db_url, data_root, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("COLUMNS", "500")   # status lines unwrapped
    cap = Powercap(tmp_path / "powercap")
    monkeypatch.setenv("PIPELINE_POWERCAP_DIR", str(cap.root))
    labels = dict(model=model_label(str(tiny_model_dir)), worker=HOST)
    before = {name: in_process(f"pipeline_{name}_total", **labels) for name in ("energy_joules", "device_seconds", "cost")}
    src = write_jsonl(tmp_path / "in.jsonl", _rows(12))
    with cap:
        result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--shard-size", "4", *FAST,
                                      "--database-url", db_url, "--cost-per-hour", str(RATE)])
    assert result.exit_code == 0, result.output
    job, shards = the_job_and_its_shards(db_url)
    assert job.num_shards == 3
    _check_measured(job, shards, cap.watts, data_root)
    assert f"energy: {job.joules:.1f} J, {job.tokens_per_joule:.2f} tokens/J; cost {job.cost:.6g}" in result.stdout
    grew = {name: in_process(f"pipeline_{name}_total", **labels) - before[name] for name in before}
    assert grew == pytest.approx({"energy_joules": job.joules, "device_seconds": job.device_seconds,
                                  "cost": job.cost})

    status = runner.invoke(main, ["status", job.id, "--database-url", db_url])
    assert status.exit_code == 0, status.output
    text = _plain(status.stdout)
    assert f"energy │ {job.joules:.1f} J, {job.tokens_per_joule:.2f} tokens/J" in text, text
    assert f"device time │ {job.device_seconds:.1f} device-s" in text
    assert f"cost │ {job.cost:.6g} (device-seconds at the workers' --cost-per-hour)" in text


@pytest.mark.parametrize("broken", ["missing", "unreadable"])
def test_without_a_readable_counter_the_joules_are_null_and_status_says_why(runner, db_url, data_root, tiny_model_dir,
                                                                            tmp_path, monkeypatch, broken):
    monkeypatch.setenv("COLUMNS", "500")
    if broken == "missing":
        where = tmp_path / "no-powercap"
        why = f"no RAPL counter: {where} does not exist"
    else:
        where = Powercap(tmp_path / "powercap").root
        path = where / "intel-rapl:0" / "energy_uj"
        path.unlink()
        path.mkdir()   # unreadable as a root-only file is to anyone else (the tests run as root)
        why = f"powercap unreadable: {path}: Is a directory"
    monkeypatch.setenv("PIPELINE_POWERCAP_DIR", str(where))
    src = write_jsonl(tmp_path / "in.jsonl", _rows(4))
    result = runner.invoke(main, ["run", str(src), "--model", str(tiny_model_dir), "--shard-size", "2", *FAST,
                                  "--database-url", db_url])   # and no rate
    assert result.exit_code == 0, result.output
    job, shards = the_job_and_its_shards(db_url)
    assert [(sh.joules, sh.cost, sh.energy_meter, sh.energy_unmeasured) for sh in shards] == [(None, None, None, why)] * 2
    assert all(sh.device_seconds > 0 for sh in shards)
    assert (job.joules, job.tokens_per_joule, job.cost, job.energy_unmeasured) == (None, None, None, why)
    assert job.device_seconds == pytest.approx(sum(sh.device_seconds for sh in shards))
    text = _plain(runner.invoke(main, ["status", job.id, "--database-url", db_url]).stdout)
    assert f"energy │ not measured ({why})" in text, text
    assert "cost │ not computed: a worker that ran it had no rate (`--cost-per-hour`, PIPELINE_COST_PER_HOUR)" in text


def test_a_worker_charges_its_overlapping_shards_without_counting_twice(cluster_factory, db_url, data_root, tmp_path):
    cap = Powercap(tmp_path / "powercap")
    c = cluster_factory(db_url, PIPELINE_POWERCAP_DIR=cap.root)
    with cap:
        worker = c.start_worker(args=["--shards-in-flight", "3", "--cost-per-hour", str(RATE)])
        job_id = c.submit(_rows(15), shard_size=3)
        job = c.wait_until_ended(job_id)
        shards = c.shards(job_id)
        assert worker.poll() is None, c.log(worker)
    _check_measured(job, shards, cap.watts, data_root)
    # Charges never overlap: together they are at most the time from the first start to the last commit.
    span = (max(sh.finished_at for sh in shards) - min(sh.started_at for sh in shards)).total_seconds()
    assert job.device_seconds <= span + 0.5
    status = c.cli("status", job_id)
    assert status.returncode == 0, status.stderr
    assert "tokens/J" in _plain(status.stdout)


def test_migration_0016_goes_down_and_up_keeping_the_jobs(db_url, ledger):
    from ledger_helpers import downgraded_schema, make_job

    _, Session = ledger
    job_id = make_job(Session)
    schema = downgraded_schema(db_url, "0015")
    assert not {"joules", "tokens_per_joule", "cost"} & schema["jobs"]
    assert not {"joules", "device_seconds", "energy_meter"} & schema["shards"]
    upgrade(db_url)
    with Session() as s:
        job = get_job(s, job_id)
        assert (job.joules, job.cost, job.energy_unmeasured) == (None, None, None)
        assert all(sh.joules is None and sh.device_seconds is None for sh in get_shards(s, job_id))


def test_a_jobs_sums_are_null_unless_every_shard_that_ran_has_them(ledger, tmp_path):
    """Through the ledger's own writes: claim (which clears an earlier attempt's charge), the commit that
    writes the charge in its fenced update (a stale attempt's commit writes nothing); shards that never
    ran do not count."""
    from jobs.ledger import claim_shard, commit_shard, job_usage
    from jobs.results.result_row import shard_totals
    from ledger_helpers import make_job

    _, Session = ledger
    job_id = make_job(Session, sizes=(1, 1, 1))
    why = "powercap unreadable: /x/energy_uj: permission denied"
    charges = {0: dict(joules=10.0, device_seconds=2.0, cost=0.5, energy_meter="rapl (package-0)",
                       energy_unmeasured=None),
               1: dict(joules=None, device_seconds=3.0, cost=None, energy_meter=None, energy_unmeasured=why)}

    def commit(s, index, attempt, usage):
        tmp = tmp_path / f"{index}-{attempt}.tmp"
        tmp.write_bytes(b"")
        return commit_shard(s, job_id, index, attempt, totals=shard_totals([]), tmp_path=tmp,
                            final_path=tmp_path / f"{index}.parquet", usage=usage)

    with Session() as s:
        assert job_usage(s, job_id)["energy_unmeasured"].startswith("no shard of it ran on a device")
        for index, charge in charges.items():
            attempt = claim_shard(s, job_id, index, "w:1", 60, 3)
            assert not commit(s, index, attempt + 1, charge)   # not the holder: nothing written
            assert job_usage(s, job_id)["device_seconds"] == (None if index == 0 else 2.0)
            with pytest.raises(ValueError, match="usage"):
                commit(s, index, attempt, {"joules": 1.0})
            assert commit(s, index, attempt, charge)
        # shard 2 never ran here (say the reaper gave it up): it has no charge and counts for nothing
        usage = job_usage(s, job_id)
    assert usage == {"joules": None, "device_seconds": 5.0, "cost": None,
                     "energy_unmeasured": f"1 of 2 shards not measured (shard 1: {why})"}
    with Session() as s:   # measured alone, shard 0's figures are the job's
        from sqlalchemy import update

        from jobs.ledger import Shard
        s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == 1).values(device_seconds=None))
        s.commit()
        assert job_usage(s, job_id) == {"joules": 10.0, "device_seconds": 2.0, "cost": 0.5, "energy_unmeasured": None}
        # a charge left on a shard its attempt never committed (as a worker that wrote it in a transaction
        # of its own, before its commit, could leave): the next claim clears it
        first = claim_shard(s, job_id, 2, "w:1", 0, 3)
        s.execute(update(Shard).where(Shard.job_id == job_id, Shard.index == 2).values(**charges[0]))
        s.commit()
        assert claim_shard(s, job_id, 2, "w:2", 60, 3) == first + 1
        shard = next(sh for sh in get_shards(s, job_id) if sh.index == 2)
        assert (shard.joules, shard.device_seconds, shard.cost, shard.energy_meter) == (None, None, None, None)
        assert commit(s, 2, first + 1, None)   # committed unmeasured (no account): still no charge
        shard = next(sh for sh in get_shards(s, job_id) if sh.index == 2)
        assert (shard.status, shard.joules, shard.device_seconds) == ("completed", None, None)
