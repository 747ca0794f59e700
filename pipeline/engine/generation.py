"""The generate() loop shared by the decoder Engine and the EncoderEngine: pull requests
lazily, step while anything is unfinished, yield each result as it finishes."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from pipeline.request import Request, RequestOutput


def generate(engine, requests: Iterable[Request],
             should_stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
    """Yield each request's result as soon as it finishes (not in input order).

    Requests are pulled lazily, so a huge iterable is never held at once. A request
    that cannot run (tokeniser failure, prompt too long) yields an error result and
    never stops the others. When `should_stop()` turns true (checked between steps),
    unfinished requests are dropped, their blocks freed, and generation ends; the same
    happens when the caller stops iterating early (closes the generator).
    """
    scheduler = engine.scheduler
    pending = iter(requests)
    exhausted = False
    try:
        while True:
            while not exhausted and len(scheduler.waiting) < engine.lookahead:
                wanted = engine.lookahead - len(scheduler.waiting)
                batch = list(itertools.islice(pending, wanted))   # tokenized together
                exhausted = len(batch) < wanted
                for errors in engine.add_requests(batch):
                    yield from errors   # the results of a request that cannot run
            if scheduler.num_unfinished == 0:
                if exhausted:
                    return
                continue
            if should_stop is not None and should_stop():
                scheduler.abort_all()
                return
            yield from engine.step()
    finally:
        # A consumer that stops early (break, close(), an exception) must not leave its
        # sequences behind, holding blocks and resurfacing in the next call.
        if scheduler.num_unfinished:
            scheduler.abort_all()
