"""One engine shared by several concurrent callers, so that their requests run in the
same batches: while one caller's last requests drain, the next caller's already run.

A background thread owns the engine and steps it while any caller has work; nothing
else touches the engine. Each `generate` call is a stream: its requests go in (pulled
lazily, a bounded number ahead), and only its own results come back, in the calling
thread, as they finish. A stream that stops (should_stop, the caller closing it, an
exception) drops only its own unfinished requests.

    loop = EngineLoop(lambda: Engine(config))   # built in the loop's thread
    for out in loop.generate(requests, should_stop=cancelled):   # from any thread
        ...

The engine is built in the loop's own thread, so one thread does all of its torch work:
libgomp gives each thread that runs parallel work a team of its own, and once a process
holds more such threads than CPUs, every team's threads stop spinning between parallel
regions and sleep in the kernel instead. An engine built in one thread and stepped in
another thus ran 8-10% of each step off the CPU on 2 cores (98% on it when one thread
does both, as in `pipeline bench`). The process should also call
pipeline.host_memory.use_one_malloc_arena() before it starts threads.

Every live loop, built or still building, is closed when the interpreter exits (atexit
runs after the non-daemon threads ended, before the daemon ones are stopped; a build is
waited for): a daemon thread stopped inside a torch op aborts the whole process
("terminate called without an active exception", pytorch#38228), so a worker that shut
down cleanly would still exit with SIGABRT.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from pipeline.request import Request, RequestOutput

if TYPE_CHECKING:
    from pipeline.engine.engine import Engine

log = logging.getLogger(__name__)

POLL_S = 0.2   # how often a waiting caller checks its should_stop (a result wakes it at once)
# Tokenizer processes by the engine's device when asked for "auto". On a GPU the host's cores
# are free and the engine thread's Python is what caps short requests: one process takes the
# chat templates and the encoding (35-60 us a 1-token chat line, benchmarks/short_requests.py
# --mode engine) off it. On a CPU the forward wants every core.
AUTO_TOKENIZER_PROCESSES = {"cuda": 1}

_live_loops: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


def _tokenizer_processes(asked: int | str, device_type: str) -> int:
    """How many tokenizer processes to start: asked ("auto": AUTO_TOKENIZER_PROCESSES), or none
    in a daemonic process, which may not have children: a child of a prefork pool (`pipeline
    worker --concurrency N`). Its loop thread tokenizes instead; asked for by number, it says so."""
    processes = AUTO_TOKENIZER_PROCESSES.get(device_type, 0) if asked == "auto" else asked
    if processes and multiprocessing.current_process().daemon:
        if asked != "auto":
            log.warning("tokenizer processes: a daemonic process (a prefork pool's child, `--concurrency`) "
                        "cannot start them; the engine's thread tokenizes")
        return 0
    return processes


@atexit.register
def _close_live_loops() -> None:
    for loop in list(_live_loops):
        loop.close()


class _Stream:
    def __init__(self, key: int):
        self.key = key
        # A round's results for this stream come as one list (one lock and one wake-up a round, not a result).
        self.results: queue.Queue[list[RequestOutput] | BaseException] = queue.Queue()
        # internal id in the engine -> its choices not finished yet (loop thread only)
        self.live_ids: dict[str, int] = {}

    def internal_id(self, request_id: str) -> str:
        # Two callers may use the same request ids (two jobs' shards): unique in the engine.
        return f"{self.key}:{request_id}"


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine],
                 observer: Callable[[object, float | None], None] | None = None,
                 tokenizer_processes: int | str = 0):
        """Build the engine with make_engine() in the loop's thread and start serving;
        whatever make_engine raises is raised here.

        observer(engine, step_s), if given, is called in the loop thread at the start of
        each round: after the last round's step or aborts, where nothing else touches the
        engine (metrics read it there), with the seconds that step took (None: no step).

        tokenizer_processes > 0: callers' prompts are tokenized in that many processes of
        their own (pipeline.engine.tokenizer_pool), else by the loop thread between steps;
        "auto": AUTO_TOKENIZER_PROCESSES for the engine's device."""
        self._observer = observer
        self._keys = itertools.count()
        self._wake = threading.Condition()
        # New requests and their prompts' ids (or what failed them; None without a pool), oldest first.
        self._inbox: list[tuple[_Stream, Request, list[int] | Exception | None]] = []
        self._aborts: list[_Stream] = []
        self.num_streams_fed = 0   # generate calls that have put requests in so far (workers.admission)
        self._streams: dict[int, _Stream] = {}
        self._closed = False
        self._crashed: BaseException | None = None   # what ended the loop thread, if anything
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="engine-loop", daemon=True)
        _live_loops.add(self)   # before the build starts: an exit mid-build must wait for it too
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.lookahead = self.engine.lookahead   # requests a stream keeps in the engine
        self._pool = None
        tokenizer_processes = _tokenizer_processes(tokenizer_processes, self.engine.device.type)
        if tokenizer_processes > 0:
            from pipeline.engine.tokenizer_pool import TokenizerPool
            self._pool = TokenizerPool(self.engine.model_dir, tokenizer_processes)

    def _start_tokenizing(self, requests: list[Request]) -> Callable[[], list[list[int] | Exception] | None]:
        """Start tokenizing requests in the pool's processes; the returned call gives their
        ids (or what failed each). Without a pool it gives None: the loop thread tokenizes
        them. (Rendering chat templates in the callers' threads instead measured slower: the
        loop thread, which takes the GIL back after each torch call, then waits for it.)"""
        if self._pool is not None:
            return self._pool.start(requests)
        return lambda: None

    @property
    def is_serving(self) -> bool:
        """False once closed or once its thread died (an engine bug): build another."""
        return not self._closed and self._crashed is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        """Requests given to the loop and not finished yet (read without a lock: a snapshot)."""
        return len(self._inbox) + self.engine.scheduler.num_unfinished

    @property
    def has_room(self) -> bool:
        """Whether the engine has less work than it keeps at hand: a full batch and as many
        again waiting (the backlog Engine.generate keeps, so a finished sequence is replaced
        at once)."""
        return self.num_unfinished < self.lookahead

    @property
    def num_streams(self) -> int:
        with self._wake:
            return len(self._streams)

    def generate(self, requests: Iterable[Request],
                 should_stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
        """As Engine.generate, but any number of threads may call it at once; their
        requests share the engine's batches. should_stop is called in this thread."""
        stream = _Stream(next(self._keys))
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            self._streams[stream.key] = stream
        pending = iter(requests)
        ready: collections.deque = collections.deque()   # (request, its ids): tokenized ahead
        next_chunk = None   # (requests, their ids when asked): the next lookahead's worth, being tokenized
        in_flight = 0
        exhausted = fed = False

        def tokenize_next():
            # The next lookahead's worth, started in the pool (_start_tokenizing) while the
            # engine runs the chunk before it.
            nonlocal exhausted
            chunk = [dataclasses.replace(request, id=stream.internal_id(request.id))
                     for request in itertools.islice(pending, self.lookahead)]
            exhausted = len(chunk) < self.lookahead
            return (chunk, self._start_tokenizing(chunk)) if chunk else None

        try:
            while True:
                if not ready and not exhausted and next_chunk is None:
                    next_chunk = tokenize_next()
                if not ready and next_chunk is not None:
                    chunk, ids = next_chunk
                    ready.extend(zip(chunk, ids() or itertools.repeat(None)))
                    next_chunk = None
                batch = []
                while ready and in_flight < self.lookahead:
                    request, ids = ready.popleft()
                    in_flight += request.params.n   # one result per choice
                    batch.append((stream, request, ids))
                if batch:
                    with self._wake:
                        self.num_streams_fed += not fed
                        fed = True
                        self._inbox.extend(batch)
                        self._wake.notify()
                if next_chunk is None and not exhausted and len(ready) < self.lookahead:
                    next_chunk = tokenize_next()   # once this batch is in
                if in_flight == 0:
                    return
                if should_stop is not None and should_stop():
                    return
                try:
                    outs = stream.results.get(timeout=POLL_S)
                except queue.Empty:
                    if self._crashed is not None:
                        raise RuntimeError("the engine loop stopped") from self._crashed
                    if self._closed and not self._thread.is_alive():
                        raise RuntimeError("the engine loop was closed")
                    continue
                if isinstance(outs, BaseException):
                    raise outs
                for out in outs:
                    in_flight -= 1
                    yield out
        finally:
            with self._wake:
                del self._streams[stream.key]
                if in_flight:
                    self._aborts.append(stream)
                    self._wake.notify()

    def close(self) -> None:
        """Stop the thread after its current step, dropping whatever is still running
        (its callers get an error); later generate calls fail."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        if self._pool is not None:
            self._pool.close()

    # ---- the loop thread ----------------------------------------------------------------

    def _run(self, make_engine) -> None:
        try:
            self.engine = make_engine()
        except BaseException as e:   # raised to the caller of __init__
            self._build_error = e
            return
        finally:
            self._built.set()
        try:
            self._serve()
        except BaseException as e:   # a bug here must not leave callers waiting for ever
            self._crashed = e
            self._fail_all(e)
            raise

    def _serve(self) -> None:
        engine = self.engine
        step_s = None
        while True:
            if self._observer is not None:
                self._observer(engine, step_s)
                step_s = None
            with self._wake:
                while not (self._closed or self._inbox or self._aborts or engine.has_unfinished_requests):
                    self._wake.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                closed = self._closed
            if closed:   # leave the engine empty for whoever uses it next
                for stream in aborts:
                    engine.abort(stream.live_ids)
                self._fail_all(RuntimeError("the engine loop was closed"))
                return
            for stream in aborts:
                engine.abort(stream.live_ids)
                stream.live_ids.clear()
            aborted = {s.key for s in aborts}
            inbox = [item for item in inbox if item[0].key not in aborted]
            requests = [request for _, request, _ in inbox]
            token_ids = [ids for *_, ids in inbox] if self._pool is not None else None   # None: tokenized here
            refused: dict[_Stream, list[RequestOutput]] = {}
            for (stream, request, _), errors in zip(inbox, engine.add_requests(requests, token_ids)):
                if not errors:
                    stream.live_ids[request.id] = request.params.n
                else:
                    refused.setdefault(stream, []).extend(errors)
            self._deliver(refused)
            if not engine.has_unfinished_requests:
                continue
            started = time.perf_counter()
            try:
                finished = engine.step()
            except BaseException as e:   # the engine dropped all its requests: tell their owners
                self._fail_all(e)
                continue
            step_s = time.perf_counter() - started
            self._deliver(self._by_stream(finished))

    def _by_stream(self, finished: list[RequestOutput]) -> dict[_Stream, list[RequestOutput]]:
        """A step's finished outputs by the live stream they belong to (a stream gone meanwhile gets none)."""
        with self._wake:
            streams = self._streams.copy()
        outs: dict[_Stream, list[RequestOutput]] = {}
        for out in finished:
            stream = streams.get(int(out.id.split(":", 1)[0]))
            if stream is not None:
                left = stream.live_ids.pop(out.id, 1) - 1
                if left:
                    stream.live_ids[out.id] = left
                outs.setdefault(stream, []).append(out)
        return outs

    @staticmethod
    def _deliver(outs: dict[_Stream, list[RequestOutput]]) -> None:
        for stream, results in outs.items():
            for out in results:
                out.id = out.id.split(":", 1)[1]   # the engine made it for this delivery alone: no copy
            stream.results.put(results)

    def _fail_all(self, error: BaseException) -> None:
        """Drop every live request (the engine may have dropped them already) and tell
        their callers."""
        with self._wake:
            streams = list(self._streams.values())
        for stream in streams:
            if stream.live_ids:
                self.engine.abort(stream.live_ids)
                stream.live_ids.clear()
                stream.results.put(error)
