"""A model's identity by content: the same files give the same fingerprint wherever the
directory is copied; any changed byte of a weight, config, tokenizer or chat template gives
another. No torch.

Hashing a checkpoint reads all of it (a 135M model in about half a second, a 7B one in
tens of seconds), so each file's digest is kept in the cache under its path, size,
modification time, inode and status-change time: a file that changed in any of those is
read again. The last one is what no writer can set back: a checkpoint rewritten in place
at the same size with its modification time restored still gets a new ctime, so it is
hashed again. The cache only saves work: a copied directory is hashed anew and gets the
same fingerprint.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pipeline.config import cache_root

_CHUNK = 1 << 22


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A 32-hex-digit digest over the directory's files (names relative to it, and contents);
    hidden files and folders (caches, partial downloads) are left out."""
    root = Path(model_dir).resolve()
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    cache = _Cache(root)
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + cache.digest(path).encode() + b"\0")
    cache.save()
    return digest.hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


class _Cache:
    """File digests of one directory, kept under the cache root (best effort: never an error)."""

    def __init__(self, root: Path):
        name = hashlib.blake2b(str(root).encode(), digest_size=8).hexdigest()
        self.path = cache_root() / "fingerprints" / f"{name}.json"
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    def digest(self, path: Path) -> str:
        stamp = _stamp(path)
        entry = self.entries.get(str(path))
        if entry is not None and entry[0] == stamp:
            return entry[1]
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if _stamp(path) == stamp:   # not written while it was read: the digest is that stamp's
            self.entries[str(path)] = [stamp, h.hexdigest()]
            self.changed = True
        return h.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError:
            pass
