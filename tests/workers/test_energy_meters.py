"""workers/energy.py's meters and its rule for charging shards: RAPL read from a powercap-shaped
directory (its packages only, across a wrap; null and a reason where it cannot be read), NVML
where there is none, and a worker's busy time split between its shards without overlap."""
from __future__ import annotations

import pytest

from energy_helpers import Powercap
from jobs.settings import Settings
from workers.energy import NvmlMeter, RaplMeter, ShardAccount, make_meter


def _set(cap: Powercap, rel: str, joules: float) -> None:
    cap._write(cap.root / rel / "energy_uj", int(joules * 1e6))


def test_rapl_counts_the_packages_only_and_across_a_wrap(tmp_path):
    cap = Powercap(tmp_path / "powercap", range_j=1000.0, start_j=990.0)   # every counter 10 J below its wrap
    meter = RaplMeter(cap.root)
    assert meter.why_unavailable is None and meter.name == "rapl (package-0, package-1)"
    assert meter.joules() == 0.0
    _set(cap, "intel-rapl:0", 5.0)        # package-0 wrapped: 10 J to the top, then 5
    _set(cap, "intel-rapl:1", 992.5)      # package-1: 2.5 J
    for rel in ("intel-rapl:0/intel-rapl:0:0", "intel-rapl:2", "intel-rapl-mmio:0"):
        _set(cap, rel, 500.0)             # a subzone, psys, a package's MMIO copy: never counted
    assert meter.joules() == pytest.approx(17.5)
    _set(cap, "intel-rapl:0", 7.0)
    assert meter.joules() == pytest.approx(19.5)   # cumulative, monotonic


def test_rapl_says_why_it_cannot_measure(tmp_path):
    missing = RaplMeter(tmp_path / "nowhere")
    assert missing.joules() is None and missing.why_unavailable == f"no RAPL counter: {tmp_path / 'nowhere'} does not exist"
    (tmp_path / "empty").mkdir()
    assert "has no intel-rapl package zone" in RaplMeter(tmp_path / "empty").why_unavailable

    cap = Powercap(tmp_path / "unreadable")
    path = cap.root / "intel-rapl:1" / "energy_uj"
    path.unlink()
    path.mkdir()   # reads fail as they do for a file only root may read (the tests run as root)
    meter = RaplMeter(cap.root)
    assert meter.joules() is None
    assert meter.why_unavailable.startswith(f"powercap unreadable: {path}")

    cap = Powercap(tmp_path / "later")
    meter = RaplMeter(cap.root)
    assert meter.joules() == 0.0
    (cap.root / "intel-rapl:0" / "energy_uj").unlink()
    assert meter.joules() is None and "powercap unreadable" in meter.why_unavailable


def test_rapl_permission_denied_is_the_reason(tmp_path):
    import os
    if os.geteuid() == 0:
        pytest.skip("root reads a file of mode 0400 anyway")
    cap = Powercap(tmp_path / "powercap")
    (cap.root / "intel-rapl:0" / "energy_uj").chmod(0)
    assert RaplMeter(cap.root).why_unavailable.endswith("energy_uj: permission denied")


def test_without_nvml_a_gpu_is_not_measured_and_a_cpu_engine_reads_rapl(tmp_path):
    gpu = NvmlMeter()   # no GPU driver here (nvidia-ml-py installed or not)
    assert gpu.joules() is None and gpu.why_unavailable.startswith("no GPU energy counter: ")
    settings = Settings(data_dir=tmp_path / "data", powercap_dir=str(tmp_path / "none"))
    assert isinstance(make_meter(settings, "cuda"), NvmlMeter)
    assert isinstance(make_meter(settings, "cpu"), RaplMeter)
    assert isinstance(make_meter(settings, "auto"), RaplMeter)   # no GPU found


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _TenWatts:
    """A meter reading 10 W x the clock (a stand-in for the device, not for anything of ours)."""
    name, why_unavailable = "ten watts", None

    def __init__(self, clock):
        self.clock = clock

    def joules(self) -> float:
        return 10.0 * self.clock()


def test_a_workers_busy_time_is_split_between_its_shards_in_commit_order():
    clock = _Clock()
    account = ShardAccount(_TenWatts(clock), cost_per_hour=36.0, clock=clock)

    def at(t, action, *args):
        clock.t = t
        return action(*args)

    a = at(0, account.enter)
    b = at(1, account.enter)
    c = at(2, account.enter)
    lost = at(3, account.enter)
    at(4, account.leave, lost)          # committed nothing: charged nothing
    charged_b = at(8, account.charge, b)
    at(8, account.leave, b)
    charged_a = at(10, account.charge, a)
    at(10, account.leave, a)
    charged_c = at(12, account.charge, c)
    at(12, account.leave, c)
    d = at(20, account.enter)           # after 8 s idle, charged to no one
    charged_d = at(25, account.charge, d)
    at(25, account.leave, d)

    seconds = [u.device_seconds for u in (charged_b, charged_a, charged_c, charged_d)]
    assert seconds == [8, 2, 2, 5]      # from the earliest start in flight, then from the last charge
    assert sum(seconds) == 12 + 5       # the busy time [0, 12] and [20, 25], nothing twice
    for usage in (charged_b, charged_a, charged_c, charged_d):
        assert usage.joules == pytest.approx(10.0 * usage.device_seconds)
        assert usage.cost == pytest.approx(usage.device_seconds * 36.0 / 3600)
        assert (usage.energy_meter, usage.energy_unmeasured) == ("ten watts", None)


def test_without_a_counter_or_a_rate_the_charge_is_time_only(tmp_path):
    clock = _Clock()
    account = ShardAccount(RaplMeter(tmp_path / "none"), cost_per_hour=None, clock=clock)
    token = account.enter()
    clock.t = 3.0
    usage = account.charge(token)
    assert (usage.joules, usage.device_seconds, usage.cost, usage.energy_meter) == (None, 3.0, None, None)
    assert usage.energy_unmeasured.startswith("no RAPL counter")


def test_the_rate_setting_is_a_finite_number_or_none(tmp_path):
    assert Settings.from_env({"PIPELINE_COST_PER_HOUR": "2.5"}, data_dir=tmp_path).cost_per_hour == 2.5
    assert Settings(data_dir=tmp_path).cost_per_hour is None
    for bad in ("x", "-1", "inf"):
        with pytest.raises(ValueError, match="PIPELINE_COST_PER_HOUR"):
            Settings.from_env({"PIPELINE_COST_PER_HOUR": bad}, data_dir=tmp_path)


def test_prefork_processes_sharing_a_device_are_not_measured(tmp_path):
    from workers import energy

    cap = Powercap(tmp_path / "powercap")
    settings = Settings(data_dir=tmp_path / "data", powercap_dir=str(cap.root), cost_per_hour=1.0)
    try:
        energy.configure(settings, "cpu", processes=2)
        assert energy.account().meter.why_unavailable == \
            "2 worker processes share one device's energy counter (--concurrency)"
        energy.configure(settings, "cpu")
        acct = energy.account()
        assert acct.meter.name == "rapl (package-0, package-1)" and acct.cost_per_hour == 1.0
        assert energy.account() is acct   # one a process
    finally:
        energy.configure(None)   # later tests: from their environment
