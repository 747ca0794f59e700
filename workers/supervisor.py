"""One child process per GPU, each pinned to its GPU before CUDA starts, kept alive, drained
on SIGTERM (`pipeline worker --gpus`, `pipeline run --gpus`).

Why each child is a fresh process (subprocess: fork and exec at once) with its GPU set in
CUDA_VISIBLE_DEVICES, and never a fork of a process that uses the engine: CUDA reads
CUDA_VISIBLE_DEVICES once, when it initialises, so a device can only be chosen for a
process before that; and CUDA's state does not survive a fork ("Cannot re-initialize CUDA
in forked subprocess"). Celery's prefork pool forks its children from a worker that has
imported torch and, on a GPU, may have initialised CUDA already, and gives every child the
same environment, so it can pin nothing: eight pool children on eight GPUs would all open
cuda:0. An exec'd child inherits no CUDA state and sees only its own GPU, as cuda:0. The
supervisor computes nothing, imports neither torch nor Celery, and counts the GPUs without
CUDA (workers/devices.py).

What the supervisor does:
* each child runs in a session of its own, so that a terminal's Ctrl-C reaches only the
  supervisor, which then signals each child once (a second SIGINT would make a Celery
  worker stop cold); and each gets SIGTERM if the supervisor dies (Linux: PR_SET_PDEATHSIG);
* a child that ends while the supervisor is not stopping is started again if `restart`
  says so, after a backoff that doubles with each quick death (1, 2, 4 ... 30 s); a child
  that dies `max_quick_deaths` times in a row, each within `stable_s` of its start, is
  crash-looping: the supervisor logs so, stops the others and reports it (gave_up);
* SIGTERM or SIGINT: the first of `stop_steps` (a signal sent to every child, or a
  callable), the next one at a second signal; it then waits for every child to end.
"""
from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

StopStep = int | Callable[[], None]   # a signal for every child, or something to do instead


@dataclass
class ChildSpec:
    """How to start one child: its name (e.g. gpu0), command line and whole environment;
    log_path: its stdout and stderr go there (appended, across restarts) instead of ours."""
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None = None


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started: float = 0.0
    quick_deaths: int = 0              # in a row, each within stable_s of its start
    restart_at: float | None = None    # a restart waiting for its backoff
    returncode: int | None = None      # of its last process
    restarts: int = 0


@dataclass
class Outcome:
    """How a supervision ended."""
    stop_signal: int | None = None            # the first SIGTERM/SIGINT received, if any
    gave_up: str | None = None                # why, when a child crash-looped
    returncodes: dict[str, int | None] = field(default_factory=dict)   # each child's last exit status
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """No crash loop, and every child's last process exited 0."""
        return self.gave_up is None and all(rc == 0 for rc in self.returncodes.values())


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], *, restart: Callable[[ChildSpec, int], bool],
                 stop_steps: Sequence[StopStep] = (signal.SIGTERM, signal.SIGQUIT),
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, stable_s: float = 120.0,
                 max_quick_deaths: int = 5, poll_s: float = 0.2):
        """restart(spec, returncode): whether a child that ended so is started again.
        stop_steps: what the first, second ... SIGTERM/SIGINT does (a signal is sent to each
        child; a callable is called instead); further signals repeat the last step."""
        self.children = [_Child(spec) for spec in specs]
        self.restart, self.stop_steps = restart, list(stop_steps)
        self.backoff_s, self.max_backoff_s, self.stable_s = backoff_s, max_backoff_s, stable_s
        self.max_quick_deaths, self.poll_s = max_quick_deaths, poll_s
        self._signals: list[int] = []   # received, not yet acted on
        self._steps_taken = 0
        self.outcome = Outcome()

    def run(self, tick: Callable[[], None] | None = None) -> Outcome:
        """Start every child and supervise them until all have ended for good (stopped,
        given up, or not to be restarted). tick: called every poll (a progress bar)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for child in self.children:
                self._start(child)
            while any(c.proc is not None or c.restart_at is not None for c in self.children):
                self._act_on_signals()
                for child in self.children:
                    self._check(child)
                if tick is not None:
                    tick()
                time.sleep(self.poll_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_left_over()
        self.outcome.returncodes = {c.spec.name: c.returncode for c in self.children}
        self.outcome.restarts = {c.spec.name: c.restarts for c in self.children}
        return self.outcome

    @property
    def stopping(self) -> bool:
        return self._steps_taken > 0

    # ---- children -------------------------------------------------------------------------

    def _start(self, child: _Child) -> None:
        spec = child.spec
        out = open(spec.log_path, "ab") if spec.log_path is not None else None
        try:
            child.proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                          preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()
        child.started, child.restart_at = time.monotonic(), None
        log.info("started %s (pid %d, CUDA_VISIBLE_DEVICES=%s)", spec.name, child.proc.pid,
                 spec.env.get("CUDA_VISIBLE_DEVICES", "unset"))

    def _check(self, child: _Child) -> None:
        if child.restart_at is not None:
            if self.stopping:
                child.restart_at = None
            elif time.monotonic() >= child.restart_at:
                child.restarts += 1
                self._start(child)
            return
        if child.proc is None or (rc := child.proc.poll()) is None:
            return
        child.proc, child.returncode = None, rc
        if self.stopping:
            log.info("%s exited (%s)", child.spec.name, describe_exit(rc))
            return
        if not self.restart(child.spec, rc):
            log.info("%s ended (%s)", child.spec.name, describe_exit(rc))
            return
        quick = time.monotonic() - child.started < self.stable_s
        child.quick_deaths = child.quick_deaths + 1 if quick else 1
        if child.quick_deaths >= self.max_quick_deaths:
            self.outcome.gave_up = (f"{child.spec.name} died {child.quick_deaths} times in a row, each within "
                                    f"{self.stable_s:g} s of its start (last: {describe_exit(rc)})")
            log.error("giving up: %s; stopping the other children", self.outcome.gave_up)
            self._take_stop_step()
            return
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (child.quick_deaths - 1))
        log.warning("%s died (%s); restarting it in %g s", child.spec.name, describe_exit(rc), delay)
        child.restart_at = time.monotonic() + delay

    def _kill_left_over(self) -> None:
        """Only when run() itself fails: no child outlives its supervisor unattended."""
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
                child.returncode = child.proc.returncode

    # ---- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        self._signals.append(signum)   # acted on in the loop, not in the handler

    def _act_on_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if self.outcome.stop_signal is None:
                self.outcome.stop_signal = signum
            log.info("%s received: %s", signal.Signals(signum).name,
                     "stopping every child" if not self.stopping else "stopping them harder")
            self._take_stop_step()

    def _take_stop_step(self) -> None:
        step = self.stop_steps[min(self._steps_taken, len(self.stop_steps) - 1)]
        self._steps_taken += 1
        if callable(step):
            step()
            return
        for child in self.children:
            child.restart_at = None
            if child.proc is not None and child.proc.poll() is None:
                try:
                    child.proc.send_signal(step)
                except ProcessLookupError:
                    pass


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


# PR_SET_PDEATHSIG: the kernel sends the child SIGTERM when its parent dies, so a supervisor
# killed outright (SIGKILL, OOM) leaves no worker running unsupervised; SIGTERM, not SIGKILL,
# so that the orphan still releases its shards. Bound here, in the parent: between fork and
# exec the child runs only this call (no import, no lock, no allocation by Python).
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def child_environment(base: dict[str, str], visible: str) -> dict[str, str]:
    """base with CUDA_VISIBLE_DEVICES naming one GPU: the child sees it alone, as cuda:0."""
    return {**base, "CUDA_VISIBLE_DEVICES": visible}


def this_command() -> tuple[list[str], list[str]]:
    """How this process was started, split for a child: (the launcher: this interpreter, its
    flags and what it ran, e.g. `-m cli`, the `pipeline` script, `-m tests.hold cli`; the
    arguments the command line parser saw, e.g. `worker --gpus all`). RuntimeError when this
    process is not a command (the CLI called from Python code: its arguments are not in sys.argv)."""
    args, orig = sys.argv[1:], getattr(sys, "orig_argv", None)
    if not args or orig is None or orig[len(orig) - len(args):] != args:
        raise RuntimeError("one child per GPU needs the `pipeline` command itself: this process was not "
                           "started as one")
    return [sys.executable, *orig[1:len(orig) - len(args)]], args
