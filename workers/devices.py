"""Which GPUs get a child process (`--gpus`), found without initialising CUDA.

The supervisor that starts one child per GPU (workers/supervisor.py) must never touch CUDA
itself: a context it made would hold memory on a GPU it does not compute on, and CUDA state
does not survive a fork. So GPUs are counted here by `nvidia-smi -L` (where it is not
installed: the /dev/nvidiaN device files), never by torch. torch.cuda.device_count() asks
NVML first and initialises CUDA only when NVML fails (MIG instances, no NVML library), but
that fallback is exactly what must not happen here, and importing torch costs seconds and
hundreds of MB in a process that computes nothing.

CUDA_VISIBLE_DEVICES, when set, says which of those GPUs this process may use, read as
CUDA reads it (torch's _parse_visible_devices does the same): numbers, or GPU-/MIG- UUIDs,
up to the first entry that is not one; a repeated entry hides them all. A child is given
one entry of it, so it sees one GPU, as cuda:0.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 20   # a busy driver can be slow to answer; a hung one must not hang the start


@dataclass(frozen=True)
class Gpu:
    """One GPU a child is pinned to."""
    index: int     # its number among this process's visible GPUs: the child's name (gpu<index>) and port offset
    visible: str   # what the child's CUDA_VISIBLE_DEVICES says: the parent's entry for it (a number or a UUID)


def count_gpus() -> int:
    """GPUs in this machine (all of them: nvidia-smi ignores CUDA_VISIBLE_DEVICES); 0 where
    there is no NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])
    try:
        done = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("nvidia-smi -L failed (%s): taking this machine for one without GPUs", e)
        return 0
    if done.returncode != 0:   # e.g. "couldn't communicate with the NVIDIA driver"
        log.warning("nvidia-smi -L failed (exit %d: %s): taking this machine for one without GPUs",
                    done.returncode, (done.stderr or done.stdout).strip()[:200])
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines())


def parse_visible_devices(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES's entries as CUDA takes them: up to the first one that is not a
    device (a negative number, anything else); none at all if one repeats."""
    entries: list[str] = []
    prefix = next((p for p in ("GPU-", "MIG-") if value.startswith(p)), None)
    for raw in value.split(","):
        if prefix is not None:
            entry = raw if raw.startswith(prefix) else None
        else:   # a number, as strtoul reads it ("1gpu" is 1)
            m = re.match(r"\s*\+?(\d+)", raw)
            entry = str(int(m[1])) if m else None
        if entry is None:
            break
        if entry in entries:
            return []
        entries.append(entry)
    return entries


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """This process's GPUs, each as a child's CUDA_VISIBLE_DEVICES would name it."""
    count = count_gpus()
    if count == 0:
        return []
    given = environ.get("CUDA_VISIBLE_DEVICES")
    return parse_visible_devices(given) if given is not None else [str(i) for i in range(count)]


def choose_gpus(spec: str | None, *, on_cpu: bool, environ: Mapping[str, str] = os.environ) -> list[Gpu]:
    """The GPUs that `--gpus spec` names; [] means one process on its own device, as before.

    spec: None (the default: every visible GPU, none without one or with --device cpu),
    "none", "all", a count "N" (the first N), or a list "0,2,5" (one alone: "3,"), the
    numbers counting this process's visible GPUs. on_cpu: every engine served computes on
    the CPU (--device cpu). Then a count or a list needs no GPU: where none is visible, the
    children are pinned to those numbers all the same and compute on the CPU (CPU-only
    tests of the supervisor; several CPU engines). ValueError: a spec that is malformed or
    names a GPU that is not there.
    """
    text = (spec or "").strip().lower()
    if text == "none" or (spec is None and on_cpu):
        return []
    gpus = visible_gpus(environ)
    if spec is None or text == "all":
        if not gpus and text == "all":
            raise ValueError("--gpus all: no GPU is visible (nvidia-smi -L lists none"
                             + (f", CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
                                if "CUDA_VISIBLE_DEVICES" in environ else "") + ")")
        return [Gpu(i, v) for i, v in enumerate(gpus)]
    indexes = _indexes(text)
    if not gpus and on_cpu:   # no GPU: pinned by number all the same, computing on the CPU
        given = environ.get("CUDA_VISIBLE_DEVICES")
        names = parse_visible_devices(given) if given else []
        return [Gpu(i, names[i] if i < len(names) else str(i)) for i in indexes]
    missing = [i for i in indexes if i >= len(gpus)]
    if missing:
        seen = f"{len(gpus)} GPU(s) are visible" if gpus else "no GPU is visible (nvidia-smi -L lists none)"
        raise ValueError(f"--gpus {spec}: {seen}, so there is no GPU {', '.join(map(str, missing))}"
                         + ("; with --device cpu the children compute on the CPU" if not gpus else ""))
    return [Gpu(i, gpus[i]) for i in indexes]


def _indexes(text: str) -> list[int]:
    """A count "N" as 0..N-1, or a list "0,2,5" ("3,": GPU 3 alone) as itself."""
    if re.fullmatch(r"\d+", text):
        count = int(text)
        if count == 0:
            raise ValueError("--gpus 0: a count must be at least 1; GPU 0 alone is written `--gpus 0,`, and "
                             "no GPU at all `--gpus none`")
        return list(range(count))
    parts = [p.strip() for p in text.split(",")]
    if parts and parts[-1] == "":
        parts.pop()   # "3,": a list of one
    if not parts or not all(re.fullmatch(r"\d+", p) for p in parts):
        raise ValueError(f"--gpus {text!r}: expected all, none, a count (2) or a list of GPU numbers (0,2,5)")
    indexes = [int(p) for p in parts]
    if len(set(indexes)) != len(indexes):
        raise ValueError(f"--gpus {text}: a GPU is named twice (one child per GPU)")
    return indexes
