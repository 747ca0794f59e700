"""Helpers of the CLI tests (tests/cli): the tiny model's fast engine options and a few requests."""
from __future__ import annotations

from cluster import TOO_LONG_FOR_TINY

FAST = ["--kv-cache-gib", "0.05", "--device", "cpu"]


def requests(n=5):
    """n small requests mixing prompts and chat messages, and one far too long for the tiny model."""
    rows = [{"id": f"r{i}", "prompt": f"Tell me about {i}", "max_tokens": 4, "temperature": 0} for i in range(n - 2)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "seed": 7})
    rows.append({"id": "too-long", "prompt": TOO_LONG_FOR_TINY, "max_tokens": 2})  # over the context
    return rows
