"""Tokenizing in other processes, for a host that must feed a fast device short requests.

A chat template renders in Python under the GIL (70-100 us a line on one core), and the
texts then encode in Rust (40-60 us a short line on two cores), so a worker whose shard
threads tokenize for the engine loop tops out near 10,000 chat lines a second on one core
of Python, whatever its GPU could do. A pool of processes, each with its own copy of the
model's tokenizer, does that work beside the worker's own GIL: EngineLoop's callers hand it
their chunks (EngineLoop(tokenizer_processes=N)) and wait with the GIL released.

The children are spawned, never forked: the worker holds torch's threads and maybe CUDA.
An id list comes back exactly as the engine's own tokenizer makes it (the same files, the
same prompts_token_ids); a request that fails to render or encode comes back as a
ValueError with the same message, failing that request alone.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import SimpleNamespace

from pipeline.prompts import prompts_token_ids

log = logging.getLogger(__name__)

CHUNK = 64   # requests a child takes at a time: enough to batch the Rust encoder, small enough to spread

_tokenizer = None   # in a child: its own tokenizer


class TokenizerPool:
    def __init__(self, model_dir: Path, processes: int):
        self._model_dir, self._processes = str(model_dir), processes
        self._lock = threading.Lock()
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self._processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_load, initargs=(self._model_dir,))

    def tokenize(self, requests: list) -> list[list[int] | Exception]:
        """As Engine.tokenize_batch (anything with prompt, messages, tools, prompt_token_ids
        and reasoning_effort), in the pool's processes; ids given are passed through here."""
        return self.start(requests)()

    def start(self, requests: list) -> Callable[[], list[list[int] | Exception]]:
        """Start tokenize(requests) in the pool; the returned call waits for its result."""
        ids: list[list[int] | Exception | None] = [None] * len(requests)
        todo = []
        for i, r in enumerate(requests):
            if r.prompt_token_ids is not None:
                ids[i] = list(r.prompt_token_ids)
            else:
                todo.append((i, SimpleNamespace(prompt=r.prompt, messages=r.messages, tools=r.tools,
                                                prompt_token_ids=None,
                                                reasoning_effort=getattr(r, "reasoning_effort", None))))
        chunks = [todo[at:at + CHUNK] for at in range(0, len(todo), CHUNK)]
        payloads = [[p for _, p in c] for c in chunks]
        pool = self._pool
        try:
            results = pool.map(_tokenize, payloads)   # submitted now
        except BrokenProcessPool:
            results = None   # a child died before: started again below

        def result() -> list[list[int] | Exception]:
            try:
                done = list(results) if results is not None else None
            except BrokenProcessPool:
                done = None
            if done is None:   # a child died (OOM, a kill): a new pool does these again, once
                log.warning("a tokenizer process died: starting the tokenizer processes again")
                done = list(self._replace(pool).map(_tokenize, payloads))
            for chunk, items in zip(chunks, done):
                for (i, _), item in zip(chunk, items):
                    ids[i] = item
            return ids
        return result

    def _replace(self, broken: ProcessPoolExecutor) -> ProcessPoolExecutor:
        """A working pool in place of `broken` (another caller may have replaced it already)."""
        with self._lock:
            if self._pool is broken:
                broken.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
            return self._pool

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _load(model_dir: str) -> None:
    global _tokenizer
    from transformers import AutoTokenizer   # as pipeline.models.loader does, without importing torch here

    from pipeline.models.offline import offline
    offline()
    _tokenizer = AutoTokenizer.from_pretrained(model_dir)


def _tokenize(prompts: list) -> list[list[int] | Exception]:
    # An exception goes back as a ValueError with its message: a template's own error type
    # may not survive pickling, and only its message is shown.
    return [ValueError(str(r)) if isinstance(r, Exception) else r for r in prompts_token_ids(_tokenizer, prompts)]
