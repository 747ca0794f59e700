"""A process whose engine build is held inside torch ops until the test releases it: a worker
stopped while its engine loads, on any machine, fast or slow.

    python -m tests.held_build cli worker ...

The real CLI, worker and engine, except that pipeline.engine.factory.build_engine first runs
torch matrix products (each one releases the GIL and takes it back, as the ops of a real
load do) until the file TEST_BUILD_RELEASE exists, having said on stderr

    building: held in torch ops

which the test waits for (a state), not a time. Like tests/crashing_worker.py, it wraps the
real code from outside; nothing here is in the product.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def _held(build, release: Path):
    def held_build(config):
        import torch

        print("building: held in torch ops", file=sys.stderr, flush=True)
        x = torch.ones(256, 256)
        while not release.exists():
            x = torch.mm(x, x).clamp_(max=1.0)
        return build(config)
    return held_build


if __name__ == "__main__":
    from pipeline.engine import factory

    factory.build_engine = _held(factory.build_engine, Path(os.environ["TEST_BUILD_RELEASE"]))
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
