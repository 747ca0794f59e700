"""Tokenizing in other processes (pipeline.engine.tokenizer_pool): through an EngineLoop with
tokenizer_processes, every request gets the ids and answer the engine's own tokenizer gives,
and a request whose chat fails to render fails alone. Real tiny model, real processes."""
from __future__ import annotations

import pytest
import torch

from pipeline import Engine, EngineConfig, Request
from pipeline.engine.engine_loop import EngineLoop
from pipeline.engine.tokenizer_pool import TokenizerPool
from engine_helpers import BIG_POOL, greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # see conftest


def mixed_requests(n: int) -> list[Request]:
    """Chats, raw prompts and token ids, each answered greedily in 3 tokens."""
    out = []
    for i in range(n):
        text = f"Is review {i} positive? " + "the food was warm " * (i % 7)
        kind = i % 3
        prompt = ({"messages": [{"role": "user", "content": text}]} if kind == 0 else
                  {"prompt": text} if kind == 1 else {"prompt_token_ids": [1 + i % 50, 7, 9]})
        out.append(Request(f"r{i}", params=greedy(3, ignore_eos=True), **prompt))
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(device="cpu", model=str(tiny_model_dir), **BIG_POOL))


def test_a_pool_gives_the_engines_own_ids(engine, tiny_model_dir):
    requests = mixed_requests(150)   # more than one CHUNK, so several children's chunks are put back in order
    pool = TokenizerPool(tiny_model_dir, 2)
    try:
        assert pool.tokenize(requests) == engine.tokenize_batch(requests)
    finally:
        pool.close()


def test_answers_through_a_pool_are_those_without_one(engine):
    requests = mixed_requests(60)
    # A message with no role: the chat template cannot render it, so this request alone fails.
    requests.append(Request("broken", messages=[{"content": "no role"}], params=greedy(3)))
    answers = {}
    for processes in (0, 1):
        loop = EngineLoop(lambda: engine, tokenizer_processes=processes)
        try:
            answers[processes] = {o.id: (o.token_ids, o.prompt_tokens, o.error) for o in loop.generate(requests)}
        finally:
            loop.close()
    assert answers[1] == answers[0]
    assert len(answers[1]) == len(requests)
    assert answers[1]["broken"][2] and "tokenisation failed" in answers[1]["broken"][2]
    assert all(error is None for rid, (_, _, error) in answers[1].items() if rid != "broken")


def test_a_pool_whose_process_died_is_started_again(engine, tiny_model_dir):
    """A tokenizer process killed (the OOM killer) breaks its pool: the next call starts a new
    one and still gives the engine's ids, so the worker does not fail every later shard."""
    import os
    import signal

    requests = mixed_requests(20)
    pool = TokenizerPool(tiny_model_dir, 1)
    try:
        assert pool.tokenize(requests) == engine.tokenize_batch(requests)
        (pid,) = pool._pool._processes   # the one child, started by the first call
        os.kill(pid, signal.SIGKILL)
        assert pool.tokenize(requests) == engine.tokenize_batch(requests)
        assert pid not in pool._pool._processes
    finally:
        pool.close()


class _ReportsCuda:
    """The CPU engine, saying it runs on a GPU: what "auto" reads to choose a pool."""
    device = torch.device("cuda")

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_auto_pools_for_an_engine_on_a_gpu_only(engine, on_gpu):
    """tokenizer_processes="auto" (the default setting): one tokenizer process for an engine on a
    GPU, whose host's cores are free; none on a CPU. The answers are the same either way."""
    requests = mixed_requests(30)
    loop = EngineLoop(lambda: _ReportsCuda(engine) if on_gpu else engine, tokenizer_processes="auto")
    try:
        assert (loop._pool is not None) == on_gpu
        if on_gpu:
            assert loop._pool._processes == 1
        pooled = {o.id: o.token_ids for o in loop.generate(requests)}
    finally:
        loop.close()
    assert pooled == {o.id: o.token_ids for o in engine.generate(requests)}


@pytest.mark.parametrize("asked", ["auto", 2])
def test_a_daemonic_process_tokenizes_in_its_engine_thread(engine, asked, monkeypatch, caplog):
    """A prefork pool's child (`pipeline worker --concurrency N`) is daemonic and may not start
    processes: there the loop thread tokenizes, even on a GPU; asked for by number, it says so."""
    import multiprocessing
    me = multiprocessing.current_process()
    monkeypatch.setattr(me, "_config", {**me._config, "daemon": True})
    loop = EngineLoop(lambda: _ReportsCuda(engine), tokenizer_processes=asked)
    try:
        assert loop._pool is None
        requests = mixed_requests(6)
        assert {o.id: o.token_ids for o in loop.generate(requests)} == \
            {o.id: o.token_ids for o in engine.generate(requests)}
    finally:
        loop.close()
    assert ("cannot start them" in caplog.text) == (asked != "auto")
