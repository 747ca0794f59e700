"""Each request id once in a file, checked in bounded memory.

While a file streams by, every id a line claims is logged as a 64-bit digest with its line
number (16 bytes a request, where a dict of the ids took about 120): a 1,000,000-line file
keeps 16 MB, and logs from line ranges scanned in separate processes join by concatenation.
Once the whole file is read, equal digests are looked for by sorting, and only the lines
whose digests meet (duplicates, or a 64-bit collision: about 1 in 10^7 for 1,000,000 ids)
are read again, to compare the ids themselves and name them in the error.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable

import numpy as np


class IdLog:
    """The ids claimed so far, as (digest, line) in the order they were claimed."""

    def __init__(self, digests: bytes = b"", lines: bytes = b""):
        self.digests, self.lines = array("Q", digests), array("Q", lines)

    def add(self, request_id: str, line: int) -> None:
        self.digests.append(digest(request_id))
        self.lines.append(line)

    def extend(self, other: "IdLog") -> None:
        """Append the log of the lines after these (the next range of the file)."""
        self.digests.extend(other.digests)
        self.lines.extend(other.lines)

    def state(self) -> tuple[bytes, bytes]:
        """What IdLog(*state) rebuilds (how a range's log crosses a process boundary)."""
        return self.digests.tobytes(), self.lines.tobytes()

    def meeting_lines(self) -> list[list[int]]:
        """The lines of each digest claimed more than once, in line order (candidates only:
        the ids themselves decide)."""
        if len(self.digests) < 2:
            return []
        digests = np.frombuffer(self.digests, dtype=np.uint64)
        lines = np.frombuffer(self.lines, dtype=np.uint64)
        order = np.argsort(digests, kind="stable")
        ordered = digests[order]
        equal = ordered[1:] == ordered[:-1]
        if not equal.any():
            return []
        groups: dict[int, list[int]] = {}
        for i in np.flatnonzero(equal):
            group = groups.setdefault(int(ordered[i]), [int(lines[order[i]])])
            group.append(int(lines[order[i + 1]]))
        return [sorted(set(g)) for g in groups.values()]


def digest(request_id: str) -> int:
    """An id's 64-bit digest (the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little")


def duplicates(log: IdLog, ids_of: Callable[[Iterable[int]], dict[int, str]]) -> dict[int, tuple[str, int]]:
    """{line: (its id, the line that claimed that id first)} for every line whose id an
    earlier line claimed. ids_of(lines): the id each of those lines claimed (read again)."""
    groups = log.meeting_lines()
    if not groups:
        return {}
    ids = ids_of({line for group in groups for line in group})
    found: dict[int, tuple[str, int]] = {}
    for group in groups:
        first: dict[str, int] = {}
        for line in group:
            rid = ids[line]
            if first.setdefault(rid, line) != line:
                found[line] = (rid, first[rid])
    return found


def duplicate_message(request_id: str, first_line: int, unit: str = "line") -> str:
    return f"duplicate id {request_id!r} (first on {unit} {first_line})"
