"""Which engine a job needs: the options that change its answers, and a short key naming them.

A job's engine options split in two:
* what the engine *is* — the model, its dtype, its quantization, its context length (and
  any option added later, unless it is listed below): jobs that differ here need
  different engines, so they get different keys, and the workers route on the key;
* where and how much a worker runs at once (WORKER_FIELDS: device, KV-cache budget,
  batch limits, weight packing, prefix caching, attention backend, CUDA graphs,
  overlapped steps). These are the worker's own: on a worker its own values apply
  whatever a job asked for, and `pipeline run` uses the job's.

The key reads `<model>-<8 hex digits>`: the model's directory name (or the bundled
model's name) for people, and a hash of the identity for exactness. It is stable across
processes and machines (same options, same key).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import fields
from pathlib import Path

from pipeline.models.bundled import BUNDLED_NAME
from pipeline.config import QUANTIZATION_REVISIONS, EngineConfig

WORKER_FIELDS = ("device", "kv_cache_gib", "gpu_memory_utilization", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "admission_group", "num_kv_blocks", "pack_weights",
                 "enable_prefix_caching", "attention_backend", "cuda_graphs", "overlap_steps")


def identity(options: dict) -> dict:
    """The options that make a different engine, every one filled in (defaults included)."""
    config = EngineConfig(**options)
    ident = {f.name: getattr(config, f.name) for f in fields(EngineConfig) if f.name not in WORKER_FIELDS}
    if config.quantization in QUANTIZATION_REVISIONS:   # absent otherwise: other keys stay as they were
        ident["quantization_revision"] = QUANTIZATION_REVISIONS[config.quantization]
    if not config.batch_invariant:
        # Absent when off: answers computed before the mode existed were computed without
        # it, and keep the key that says so; an invariant engine has a key of its own.
        del ident["batch_invariant"]
    return ident


def engine_key(options: dict) -> str:
    """The short stable key of the engine that `options` (EngineConfig fields) need."""
    ident = identity(options)
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]
    name = Path(ident["model"]).name if ident["model"] else BUNDLED_NAME
    return f"{re.sub(r'[^a-z0-9._]+', '-', name.lower()).strip('-.') or 'model'}-{digest}"


def ran_batch_invariant(options: dict, key: str | None) -> bool:
    """Whether the job of these options and engine key ran batch-invariant (a job recorded
    before the mode existed has the key of its options without it)."""
    try:
        return bool(identity(options).get("batch_invariant")) and engine_key(options) == key
    except (TypeError, ValueError):   # options of an older release that EngineConfig no longer takes
        return False
