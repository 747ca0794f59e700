"""Every name under the data root (see docs/contracts.md): the SQLite ledger, and each job's files.

Job ids are the only user-visible strings that become path components, so they are
checked against a strict pattern and every derived path is verified to stay under root.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

_JOB_ID = re.compile(r"job_[0-9a-f]{16}")
_FILE_ID = re.compile(r"file-[0-9a-f]{24}")
FILES_DIR = "files"   # the HTTP API's files, <root>/files/<file id>.jsonl
RESULT_SHARD_GLOB = "shard-*.parquet"  # the committed results of a job, as readers find them
# An uncommitted attempt in results/_tmp; ".reaper" marks the error rows a reaper writes.
_TMP_RESULT = re.compile(r"shard-(\d+)\.attempt-(\d+)(\.reaper)?\.parquet")


def default_database_url(root: Path | str) -> str:
    """The SQLite ledger inside the data root."""
    return f"sqlite:///{(Path(root).resolve() / 'ledger.sqlite').as_posix()}"


def input_shard_name(index: int) -> str:
    return f"shard-{_index(index):05d}.jsonl"


def result_shard_files(results_dir: Path | str) -> list[Path]:
    """The committed result files of a results directory, in shard order."""
    return sorted(Path(results_dir).glob(RESULT_SHARD_GLOB))


def new_job_id() -> str:
    """A fresh job id: ``job_`` + 16 random hex chars."""
    return "job_" + secrets.token_hex(8)


def check_job_id(job_id: str) -> str:
    """Return job_id unchanged, or raise ValueError if it is not a well-formed job id."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"invalid job id {job_id!r} (expected job_ + 16 lowercase hex chars)")
    return job_id


def new_file_id() -> str:
    """A fresh id of an HTTP API file: ``file-`` + 24 random hex chars."""
    return "file-" + secrets.token_hex(12)


def check_file_id(file_id: str) -> str:
    """Return file_id unchanged, or raise ValueError if it is not a well-formed file id."""
    if not isinstance(file_id, str) or not _FILE_ID.fullmatch(file_id):
        raise ValueError(f"invalid file id {file_id!r} (expected file- + 24 lowercase hex chars)")
    return file_id


def files_dir(root: Path | str) -> Path:
    return Path(root).resolve() / FILES_DIR


def file_path(root: Path | str, file_id: str) -> Path:
    """Where the bytes of an HTTP API file live; the id is checked, the path kept under root."""
    path = files_dir(root) / f"{check_file_id(file_id)}.jsonl"
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise ValueError(f"{path} escapes the data root {root}")
    return path


@dataclass(frozen=True)
class JobPaths:
    """The files of one job under ``<root>/jobs/<job_id>/``."""

    root: Path
    job_id: str

    def __post_init__(self) -> None:
        check_job_id(self.job_id)
        object.__setattr__(self, "root", Path(self.root).resolve())

    def _under_root(self, path: Path) -> Path:
        # Defence in depth: the id check already rules out traversal, this rules out symlinks too.
        if not path.resolve().is_relative_to(self.root):
            raise ValueError(f"{path} escapes the data root {self.root}")
        return path

    @property
    def dir(self) -> Path:
        return self._under_root(self.root / "jobs" / self.job_id)

    @property
    def input_dir(self) -> Path:
        return self._under_root(self.dir / "input")

    @property
    def stdin_copy(self) -> Path:
        """A job read from standard input keeps what it read here (its input_path)."""
        return self._under_root(self.dir / "stdin.jsonl")

    @property
    def results_dir(self) -> Path:
        return self._under_root(self.dir / "results")

    @property
    def tmp_dir(self) -> Path:
        """Uncommitted attempts; the leading underscore hides it from pyarrow/DuckDB globs."""
        return self._under_root(self.results_dir / "_tmp")

    @property
    def stats_file(self) -> Path:
        return self._under_root(self.dir / "stats.parquet")

    def input_shard(self, index: int) -> Path:
        return self._under_root(self.input_dir / input_shard_name(index))

    def result_shard(self, index: int) -> Path:
        return self._under_root(self.results_dir / f"shard-{_index(index):05d}.parquet")

    def tmp_result(self, index: int, attempt: int, *, by_reaper: bool = False) -> Path:
        """Attempt numbers are unique per shard (fencing tokens), so a worker's name is never
        shared; a reaper writing an exhausted shard's error rows uses its own name."""
        reaper = ".reaper" if by_reaper else ""
        return self._under_root(self.tmp_dir / f"shard-{_index(index):05d}.attempt-{_index(attempt)}{reaper}.parquet")

    def tmp_results(self) -> list[tuple[Path, tuple[int, int, bool]]]:
        """The uncommitted attempts in tmp_dir, each with its (index, attempt, by_reaper)."""
        if not self.tmp_dir.is_dir():
            return []
        found = ((path, _TMP_RESULT.fullmatch(path.name)) for path in self.tmp_dir.iterdir())
        return [(path, (int(m[1]), int(m[2]), m[3] is not None)) for path, m in found if m]


def _index(value: int) -> int:
    # Reject bools and negatives: they would format into surprising file names.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative int, got {value!r}")
    return value
