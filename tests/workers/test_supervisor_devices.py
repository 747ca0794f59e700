"""--gpus without a GPU: the GPUs counted by a real `nvidia-smi -L` process (a fake one on PATH,
printing what the real one prints), CUDA_VISIBLE_DEVICES read as CUDA reads it, and the
supervisor's own rules (crash loop, a supervisor that dies) with plain child processes.
The supervisor with real workers: test_supervisor.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polling import wait_until
from workers.devices import Gpu, choose_gpus, parse_visible_devices
from workers.supervisor import ChildSpec, Supervisor

SMI_THREE = ("GPU 0: NVIDIA H200 (UUID: GPU-aaaa)\nGPU 1: NVIDIA H200 (UUID: GPU-bbbb)\n"
             "GPU 2: NVIDIA H200 (UUID: GPU-cccc)\n")


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """Put an `nvidia-smi` first on PATH that prints `listing` for -L (and exits `code`)."""
    def install(listing: str, code: int = 0) -> None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 2\nprintf '%s' '{listing}'\nexit {code}\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return install


@pytest.mark.parametrize("value, entries", [
    ("0,1", ["0", "1"]), ("2, 0", ["2", "0"]), ("1gpu,3", ["1", "3"]), ("0,-1,2", ["0"]), ("", []),
    ("0,0", []), ("GPU-aa,GPU-bb,3", ["GPU-aa", "GPU-bb"]), ("MIG-x", ["MIG-x"]), ("x,1", []),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, entries):
    assert parse_visible_devices(value) == entries


def test_gpus_are_counted_by_nvidia_smi_and_narrowed_by_cuda_visible_devices(nvidia_smi):
    nvidia_smi(SMI_THREE)
    env: dict[str, str] = {}
    assert choose_gpus(None, on_cpu=False, environ=env) == [Gpu(0, "0"), Gpu(1, "1"), Gpu(2, "2")]
    assert choose_gpus("all", on_cpu=False, environ=env) == choose_gpus(None, on_cpu=False, environ=env)
    assert choose_gpus("2", on_cpu=False, environ=env) == [Gpu(0, "0"), Gpu(1, "1")]
    assert choose_gpus("2,0", on_cpu=False, environ=env) == [Gpu(2, "2"), Gpu(0, "0")]
    assert choose_gpus("1,", on_cpu=False, environ=env) == [Gpu(1, "1")]
    assert choose_gpus("none", on_cpu=False, environ=env) == []
    assert choose_gpus(None, on_cpu=True, environ=env) == []   # --device cpu: one process, as before
    visible = {"CUDA_VISIBLE_DEVICES": "GPU-cccc,GPU-aaaa"}   # numbered as this process sees them
    assert choose_gpus("all", on_cpu=False, environ=visible) == [Gpu(0, "GPU-cccc"), Gpu(1, "GPU-aaaa")]
    assert choose_gpus("1,", on_cpu=False, environ=visible) == [Gpu(1, "GPU-aaaa")]
    with pytest.raises(ValueError, match="2 GPU.s. are visible, so there is no GPU 2"):
        choose_gpus("0,2", on_cpu=False, environ=visible)


@pytest.mark.parametrize("spec, message", [
    ("0", "GPU 0 alone is written `--gpus 0,`"), ("1,1", "named twice"), ("a,b", "expected all, none"),
    ("-1", "expected all, none"), ("", "expected all, none"),
])
def test_a_malformed_gpus_is_refused_saying_what_is_expected(nvidia_smi, spec, message):
    nvidia_smi(SMI_THREE)
    with pytest.raises(ValueError, match=message):
        choose_gpus(spec, on_cpu=False, environ={})


@pytest.mark.parametrize("listing, code", [("", 0), ("NVIDIA-SMI has failed because it couldn't communicate", 9)])
def test_without_a_gpu_the_default_is_one_process_and_a_list_needs_device_cpu(nvidia_smi, listing, code):
    nvidia_smi(listing, code)
    assert choose_gpus(None, on_cpu=False, environ={}) == []   # a CPU machine: today's worker
    with pytest.raises(ValueError, match="no GPU is visible"):
        choose_gpus("all", on_cpu=True, environ={})
    with pytest.raises(ValueError, match="with --device cpu the children compute on the CPU"):
        choose_gpus("0,1", on_cpu=False, environ={})
    # the CPU-only way to run the supervisor: pinned by number, computing on the CPU
    assert choose_gpus("0,1", on_cpu=True, environ={}) == [Gpu(0, "0"), Gpu(1, "1")]
    assert choose_gpus("2", on_cpu=True, environ={"CUDA_VISIBLE_DEVICES": "5,7"}) == [Gpu(0, "5"), Gpu(1, "7")]


def test_the_supervisor_modules_import_neither_torch_nor_celery():
    code = ("import sys, workers.devices, workers.supervisor, cli.gpus; "
            "print(sorted({'celery', 'torch'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---- the supervisor's rules, with plain children ---------------------------------------------------

SLEEPER = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(120)"


def test_a_crash_looping_child_is_given_up_and_the_others_are_stopped(tmp_path):
    failing = ChildSpec("gpu0", [sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ))
    healthy = ChildSpec("gpu1", [sys.executable, "-c", SLEEPER], {**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
                        log_path=tmp_path / "gpu1.log")
    supervisor = Supervisor([failing, healthy], restart=lambda spec, rc: True, backoff_s=0.01, max_backoff_s=0.05,
                            stable_s=60, max_quick_deaths=3, poll_s=0.05)
    outcome = supervisor.run()
    assert outcome.gave_up and "gpu0 died 3 times in a row" in outcome.gave_up and "exit 3" in outcome.gave_up
    assert outcome.restarts == {"gpu0": 2, "gpu1": 0}
    assert outcome.returncodes == {"gpu0": 3, "gpu1": 0}   # the healthy one was stopped (SIGTERM), cleanly
    assert not outcome.clean


def test_children_are_not_restarted_when_the_rule_says_so():
    specs = [ChildSpec(f"gpu{i}", [sys.executable, "-c", f"import sys; sys.exit({i})"], dict(os.environ))
             for i in range(2)]
    outcome = Supervisor(specs, restart=lambda spec, rc: rc < 0, poll_s=0.05).run()
    assert outcome.returncodes == {"gpu0": 0, "gpu1": 1} and outcome.restarts == {"gpu0": 0, "gpu1": 0}


def test_children_get_sigterm_when_their_supervisor_is_killed(tmp_path):
    """A supervisor SIGKILLed (OOM) leaves no child running unsupervised (PR_SET_PDEATHSIG)."""
    pids = tmp_path / "pids"
    child = f"import os; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); {SLEEPER}"
    script = textwrap.dedent(f"""
        import os, sys
        from workers.supervisor import ChildSpec, Supervisor
        specs = [ChildSpec(f"gpu{{i}}", [sys.executable, "-c", {child!r}], dict(os.environ)) for i in range(2)]
        Supervisor(specs, restart=lambda spec, rc: True).run()
    """)
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    try:
        started = wait_until("both children started", lambda: pids.exists()
                             and len(found := pids.read_text().split()) == 2 and found)
    finally:
        supervisor.kill()
        supervisor.wait()
    wait_until("the orphaned children to exit", lambda: not any(_alive(int(pid)) for pid in started))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"   # a zombie has exited (its new parent reaps it when it will)


def test_a_stop_signal_is_forwarded_once_and_the_supervisor_reports_it(tmp_path):
    """SIGTERM to the supervisor's process: each child gets SIGTERM and exits 0; so does the run."""
    ready = tmp_path / "ready"
    child = f"import os; open({str(ready)!r}, 'a').write('x'); {SLEEPER}"
    script = textwrap.dedent(f"""
        import os, sys
        from workers.supervisor import ChildSpec, Supervisor
        specs = [ChildSpec(f"gpu{{i}}", [sys.executable, "-c", {child!r}], dict(os.environ)) for i in range(2)]
        outcome = Supervisor(specs, restart=lambda spec, rc: True).run()
        print(outcome.stop_signal, outcome.returncodes, outcome.clean)
    """)
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                                  stdout=subprocess.PIPE, text=True)
    try:
        wait_until("both children started", lambda: ready.exists() and len(ready.read_text()) == 2)
        supervisor.send_signal(signal.SIGTERM)
        out, _ = supervisor.communicate(timeout=60)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert out.strip() == f"{int(signal.SIGTERM)} {{'gpu0': 0, 'gpu1': 0}} True"


@pytest.mark.parametrize("args, message", [
    (["worker", "--gpus", "0,1"], "no GPU is visible (nvidia-smi -L lists none), so there is no GPU 0, 1; with "
                                  "--device cpu the children compute on the CPU"),
    (["worker", "--gpus", "0", "--device", "cpu"], "GPU 0 alone is written `--gpus 0,`"),
    (["worker", "--gpus", "0,1", "--device", "cpu", "--metrics-port", "65535"], "GPU 1's port would pass 65535"),
    (["run", "FILE", "--gpus", "all", "--device", "cpu"], "--gpus all: no GPU is visible"),
])
def test_gpus_that_are_not_there_are_a_usage_error_before_anything_starts(nvidia_smi, runner, data_root, tmp_path,
                                                                          args, message):
    from cli import main

    nvidia_smi("")
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n')
    result = runner.invoke(main, [str(src) if a == "FILE" else a for a in args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (data_root / "jobs").exists()   # no job made
