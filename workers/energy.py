"""Energy, device time and cost per shard: read from the device's own counter, never estimated.

Meters (one per worker process, chosen on its first shard):

* NVML, on a GPU: `nvmlDeviceGetTotalEnergyConsumption` (millijoules since the driver
  loaded) summed over the GPUs this process sees (CUDA_VISIBLE_DEVICES, as `--gpus` pins
  each worker: NVML numbers GPUs as nvidia-smi does; or their UUIDs). Needs nvidia-ml-py
  (`pip install 'batch-pipeline[gpu]'`), imported only when the engine is not on the CPU.
* RAPL, on a CPU: `<PIPELINE_POWERCAP_DIR>/intel-rapl:N/energy_uj` (microjoules) of each
  top-level package zone (name `package-N`), not their subzones (core, uncore, dram: parts
  of the package or outside it) nor `psys`, so nothing is counted twice. A counter wraps at
  its `max_energy_range_uj`: each read adds the step since the last read (a smaller value
  having wrapped: range - last + now), and a sampler thread reads every SAMPLE_S seconds so no wrap passes unseen. Reading it
  usually needs root (since 2020 `energy_uj` is mode 0400): then nothing is measured.

Where no counter can be read, joules are None and `why_unavailable` says why; that reason
goes on the shard (`energy_unmeasured`) and `pipeline status` shows it.

Attribution (ShardAccount): a worker runs several shards at once in one engine, so a
shard's own energy cannot be told from the others'. Each committed shard is charged the
energy and the device-seconds of its worker process between the later of (a) this
process's previous charge and (b) the start of the earliest shard still in flight (itself
included: each is entered when run_shard starts), and its own charge, just before its
commit. So a worker's charges never overlap and, together, cover every moment it had a
shard in flight: its busy time is split between its shards, in commit order, and its idle
time between jobs is charged to no one. An attempt that commits nothing (lost, released,
crashed) is charged nothing: its time goes to the next shard committed while it ran, if
any. Cost is device-seconds x the worker's `--cost-per-hour` / 3600 (null without a rate).
One process, one device: with `--concurrency N` (N > 1 prefork processes on one device) each
process would count the whole device's energy, so nothing is measured there.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.settings import Settings
from workers.devices import parse_visible_devices

log = logging.getLogger(__name__)

SAMPLE_S = 5.0   # RAPL's sampler: a 262 kJ range wraps after 13 min at 330 W
_PACKAGE_ZONE = re.compile(r"intel-rapl:\d+")


class RaplMeter:
    """The packages' energy from Linux powercap (RAPL), as a monotonic total in joules."""

    def __init__(self, powercap_dir: str | os.PathLike):
        self.dir = Path(powercap_dir)
        self._lock = threading.Lock()
        self._zones: list[tuple[str, Path, int]] = []   # (name, energy_uj file, max range µJ)
        self._last: list[int] = []
        self._total_uj = 0
        self.why_unavailable: str | None = None
        self.name = "rapl"
        try:
            self._open()
        except OSError as e:
            self.why_unavailable = f"powercap unreadable: {_os_error(e)}"

    def _open(self) -> None:
        if not self.dir.is_dir():
            self.why_unavailable = f"no RAPL counter: {self.dir} does not exist"
            return
        for zone in sorted(self.dir.iterdir(), key=lambda p: _zone_number(p.name)):
            if not _PACKAGE_ZONE.fullmatch(zone.name):
                continue
            name = (zone / "name").read_text().strip()
            if name.startswith("package"):
                self._zones.append((name, zone / "energy_uj", int((zone / "max_energy_range_uj").read_text())))
        if not self._zones:
            self.why_unavailable = f"no RAPL counter: {self.dir} has no intel-rapl package zone"
            return
        self._last = [int(path.read_text()) for _, path, _ in self._zones]
        self.name = f"rapl ({', '.join(name for name, _, _ in self._zones)})"

    def joules(self) -> float | None:
        """Joules counted since this meter was made; None once a counter cannot be read."""
        with self._lock:
            if self.why_unavailable is not None:
                return None
            try:
                now = [int(path.read_text()) for _, path, _ in self._zones]
            except (OSError, ValueError) as e:
                self.why_unavailable = f"powercap unreadable: {_os_error(e)}"
                return None
            for i, ((_, _, span), before, after) in enumerate(zip(self._zones, self._last, now)):
                self._total_uj += after - before if after >= before else span - before + after   # it wrapped
                self._last[i] = after
            return self._total_uj / 1e6


class NvmlMeter:
    """The total energy of the GPUs this process sees, from NVML, in joules."""

    def __init__(self):
        self.name = "nvml"
        self.why_unavailable: str | None = None
        self._handles: list = []
        try:
            import pynvml
        except ImportError:
            self.why_unavailable = "no GPU energy counter: nvidia-ml-py is not installed (pip install 'batch-pipeline[gpu]')"
            return
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            names = (parse_visible_devices(visible) if visible is not None
                     else [str(i) for i in range(pynvml.nvmlDeviceGetCount())])
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(int(v)) if v.isdigit()
                             else pynvml.nvmlDeviceGetHandleByUUID(v) for v in names]
            if not self._handles:
                self.why_unavailable = "no GPU energy counter: this process sees no GPU"
                return
            self._start_mj = self._read_mj()
            self.name = f"nvml (GPU {', '.join(names)})"
        except pynvml.NVMLError as e:
            self.why_unavailable = f"no GPU energy counter: NVML: {e}"

    def _read_mj(self) -> int:
        return sum(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self._handles)

    def joules(self) -> float | None:
        if self.why_unavailable is not None:
            return None
        try:
            return (self._read_mj() - self._start_mj) / 1e3
        except self._nvml.NVMLError as e:
            self.why_unavailable = f"GPU energy counter unreadable: NVML: {e}"
            return None


class Unmeasured:
    """No meter: joules are None, for `why_unavailable`."""

    name = None

    def __init__(self, why: str):
        self.why_unavailable = why

    def joules(self) -> None:
        return None


def make_meter(settings: Settings, device: str | None = None):
    """The meter of this process's device: NVML where the engine computes on CUDA ("cuda"; for
    "auto" or None, where NVML finds a GPU or torch sees one), else RAPL."""
    if device != "cpu":
        gpu = NvmlMeter()
        if gpu.why_unavailable is None or device == "cuda" or _cuda_available():
            return gpu
    return RaplMeter(settings.powercap_dir)


def _cuda_available() -> bool:
    """Whether an "auto" engine computes on CUDA (as pipeline.config decides), asked only once NVML
    failed: a GPU without a readable counter is not measured by the CPU's."""
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


@dataclass(frozen=True)
class Usage:
    """What one shard was charged."""
    joules: float | None
    device_seconds: float
    cost: float | None
    energy_meter: str | None
    energy_unmeasured: str | None


@dataclass(frozen=True)
class _Mark:
    t: float
    joules: float | None


class ShardAccount:
    """One process's charges (see the module's doc): enter() as a shard starts, charge() just
    before it commits, leave() as it ends, whatever happened."""

    def __init__(self, meter, cost_per_hour: float | None = None, clock=time.monotonic, sample_s: float | None = None):
        self.meter, self.cost_per_hour, self.clock = meter, cost_per_hour, clock
        self._lock = threading.Lock()
        self._in_flight: dict[int, _Mark] = {}
        self._last: _Mark | None = None
        self._next = 0
        self._closed = threading.Event()
        if sample_s and isinstance(meter, RaplMeter) and meter.why_unavailable is None:
            threading.Thread(target=self._sample, args=(sample_s,), name="energy-sampler", daemon=True).start()

    def _mark(self) -> _Mark:
        return _Mark(self.clock(), self.meter.joules())

    def _sample(self, period_s: float) -> None:
        while not self._closed.wait(period_s) and self.meter.why_unavailable is None:
            self.meter.joules()

    def close(self) -> None:
        """Stop the sampler (configure() replaced this account)."""
        self._closed.set()

    def enter(self) -> int:
        with self._lock:
            self._next += 1
            self._in_flight[self._next] = self._mark()
            return self._next

    def leave(self, token: int) -> None:
        with self._lock:
            self._in_flight.pop(token, None)

    def charge(self, token: int) -> Usage:
        with self._lock:
            now = self._mark()
            start = min(self._in_flight.values(), key=lambda m: m.t, default=now)
            since = self._last if self._last is not None and self._last.t > start.t else start
            self._last = now
        seconds = max(now.t - since.t, 0.0)
        joules = now.joules - since.joules if now.joules is not None and since.joules is not None else None
        why = None if joules is not None else (self.meter.why_unavailable or "the energy counter was not readable "
                                                                            "when the shard started")
        return Usage(joules=joules, device_seconds=seconds,
                     cost=seconds * self.cost_per_hour / 3600 if self.cost_per_hour is not None else None,
                     energy_meter=self.meter.name if joules is not None else None, energy_unmeasured=why)


# ---- this process ----------------------------------------------------------------------------

_config: tuple[Settings | None, str | None, int] = (None, None, 1)
_accounts: dict[int, ShardAccount] = {}   # by pid: a prefork child makes its own
_making = threading.Lock()
_token: contextvars.ContextVar[int | None] = contextvars.ContextVar("energy_token", default=None)


def configure(settings: Settings | None, device: str | None = None, processes: int = 1) -> None:
    """This process's rate and powercap directory (settings; None, or never configured: from the
    environment), its engine's device ("cpu", "cuda", None or "auto"), and how many engine
    processes share the device (prefork)."""
    global _config
    with _making:
        _config = (settings, device, processes)
        for old in _accounts.values():
            old.close()
        _accounts.clear()


def account() -> ShardAccount:
    """This process's account, made (and its meter opened) on first use."""
    with _making:
        pid = os.getpid()
        if pid not in _accounts:
            settings, device, processes = _config
            settings = settings or Settings.from_env()
            meter = (make_meter(settings, device) if processes <= 1 else
                     Unmeasured(f"{processes} worker processes share one device's energy counter (--concurrency)"))
            if meter.why_unavailable:
                log.info("energy not measured: %s", meter.why_unavailable)
            _accounts[pid] = ShardAccount(meter, settings.cost_per_hour, sample_s=SAMPLE_S)
        return _accounts[pid]


def accounts_shards(run_shard):
    """Decorate run_shard: its shard is in flight for the account while it runs."""
    @functools.wraps(run_shard)
    def wrapper(*args, **kwargs):
        try:
            acct = account()
            token = acct.enter()
        except Exception:   # measuring never stops a shard
            log.warning("the energy account failed", exc_info=True)
            return run_shard(*args, **kwargs)
        reset = _token.set(token)
        try:
            return run_shard(*args, **kwargs)
        finally:
            _token.reset(reset)
            acct.leave(token)
    return wrapper


def charge_shard(job_id: str, index: int) -> Usage | None:
    """Charge the shard run_shard is about to commit (see the module's doc) and return it, for
    the commit to write on the shard in the same fenced update (ledger.commit_shard's usage);
    None when not measured (a failure is logged, never raised)."""
    token = _token.get()
    if token is None:
        return None
    try:
        return account().charge(token)
    except Exception:
        log.warning("measuring the energy of %s/%d failed", job_id, index, exc_info=True)
        return None


def _zone_number(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in name.split(":")[1:]) or (-1,)


def _os_error(e: Exception) -> str:
    if isinstance(e, PermissionError):
        return f"{e.filename}: permission denied"
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror or e}"
    return str(e)
