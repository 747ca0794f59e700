"""A powercap-shaped directory (Linux RAPL) whose counters a thread advances at fixed watts,
for the energy tests (workers/energy.py reads it through PIPELINE_POWERCAP_DIR)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

PACKAGE_W = {"package-0": 60.0, "package-1": 40.0}   # the meter counts these: 100 W in all
NOISE_W = 1000.0   # what it must not count: a package's subzone, psys, the MMIO copy of a package


class Powercap:
    """<dir>/intel-rapl:0 (package-0, with its subzone intel-rapl:0:0 "core" inside and beside it,
    as the kernel lists it), intel-rapl:1 (package-1), intel-rapl:2 (psys) and intel-rapl-mmio:0.
    Every counter starts start_j below its wrap (range_j), so a run of a few seconds wraps."""

    def __init__(self, root: Path, range_j: float = 1000.0, start_j: float | None = None):
        self.root, self.range_uj = Path(root), int(range_j * 1e6)
        self.start_uj = self.range_uj - int(50e6) if start_j is None else int(start_j * 1e6)
        self.files: dict[Path, float] = {}   # energy_uj file -> watts
        self._zone("intel-rapl:0", "package-0", PACKAGE_W["package-0"])
        self._zone("intel-rapl:0/intel-rapl:0:0", "core", NOISE_W)
        (self.root / "intel-rapl:0:0").symlink_to(self.root / "intel-rapl:0" / "intel-rapl:0:0")
        self._zone("intel-rapl:1", "package-1", PACKAGE_W["package-1"])
        self._zone("intel-rapl:2", "psys", NOISE_W)
        self._zone("intel-rapl-mmio:0", "package-0", NOISE_W)
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def watts(self) -> float:
        return sum(PACKAGE_W.values())

    def _zone(self, rel: str, name: str, watts: float) -> None:
        zone = self.root / rel
        zone.mkdir(parents=True)
        (zone / "name").write_text(name + "\n")
        (zone / "max_energy_range_uj").write_text(f"{self.range_uj}\n")
        self.files[zone / "energy_uj"] = watts
        self._write(zone / "energy_uj", self.start_uj)

    def _write(self, path: Path, value: int) -> None:
        tmp = path.with_name(".energy_uj.tmp")   # whole values only, as sysfs gives them
        tmp.write_text(f"{value}\n")
        os.replace(tmp, path)

    def advance(self) -> None:
        """Set every counter to what its watts made since the start (modulo its range)."""
        elapsed = time.monotonic() - self._t0
        for path, watts in self.files.items():
            self._write(path, (self.start_uj + int(watts * 1e6 * elapsed)) % self.range_uj)

    def __enter__(self) -> "Powercap":
        def run():
            while not self._stop.wait(0.001):
                self.advance()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=run, name="fake-rapl", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
