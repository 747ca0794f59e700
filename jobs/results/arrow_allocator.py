"""Arrow's allocator for the processes that write results: the system's malloc.

pyarrow allocates through mimalloc by default, which keeps the pages it frees for later
reuse: `pipeline run` of 5,000 embedding lines (all-MiniLM-L6-v2, shard after shard of
vector rows) peaked at 809 MB with it, 677 MB with the system allocator, and pyarrow's
release_unused() after each shard gave nothing back. The entry points (the `pipeline`
command, the Celery app) call use_system_allocator() before pyarrow is imported; an
ARROW_DEFAULT_MEMORY_POOL the user set wins.
"""
from __future__ import annotations

import os


def use_system_allocator() -> None:
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
