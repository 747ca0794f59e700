"""A job of several models (`--model A --model B`): which model answers each line, and its shards'
engines.

Each line names its model (body.model in OpenAI lines, `model` in ours) by the names one model's
job takes: its served names (--served-model-name NAME=MODEL) where it was given some, else the
model as given or its directory's name. A line naming none, or a model not among
the job's, is a bad line (jobs.input.line_checks.SeveralModels). Once the file is valid its shards
are rewritten so that each holds one model's lines (jobs.input.shard_files.group_by_model), and
each shard's ledger row names its engine: the key of the queue it is sent on, the options a worker
builds the engine from, the fingerprint its rows and answer keys carry. A job of one model has none
of this: its rows stay as they were.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jobs.input.line_checks import SeveralModels
from jobs.input.shard_files import group_by_model
from jobs.input.validation import Limits
from jobs.reuse.answer_key import engine_fingerprint
from pipeline.engine_key import engine_key
from pipeline.models.model_dir import vocabulary_size


class SeveralEngines:
    """The models of one job: models is [(the model as given, its engine options)] in --model order."""

    def __init__(self, models: list[tuple[str, dict]], served_names: tuple[str, ...] = ()):
        """served_names: --served-model-name's NAME=MODEL, MODEL one of the models (as given or by its
        directory's name): a model given names is named by exactly those, as one model's job is."""
        self.models = [name for name, _ in models]
        self.options = [options for _, options in models]
        # MODEL of NAME=MODEL: a model as given, or by its directory's name where no other has it
        dir_names = [Path(name).name for name in self.models]
        own = {**{d: i for i, d in enumerate(dir_names) if dir_names.count(d) == 1},
               **{name: i for i, name in enumerate(self.models)}}
        self.served_names: list[list[str]] = [[] for _ in self.models]
        for served in served_names:
            alias, equals, model = served.partition("=")
            if not (alias and equals and model in own):
                raise ValueError(f"--served-model-name {served!r}: a job of several models takes NAME=MODEL, "
                                 f"MODEL one of {', '.join(map(repr, self.models))} (or its directory's name, "
                                 "if no other has it)")
            if alias not in self.served_names[own[model]]:
                self.served_names[own[model]].append(alias)
        self._index: dict[str, int] = {}
        for index, name in enumerate(self.models):
            for alias in self.served_names[index] or dict.fromkeys((name, Path(name).name)):
                if self._index.setdefault(alias, index) != index:
                    raise ValueError(f"the models {self.models[self._index[alias]]!r} and {name!r} are both "
                                     f"called {alias!r}: a line could not say which it means")
        self.names = SeveralModels(self._index)   # what a line may name (jobs.input.line_checks)
        self.keys = [engine_key(options) for options in self.options]
        self._fingerprints: dict[int, str | None] = {}

    def fingerprint(self, model: int) -> str | None:
        """The model's engine fingerprint: reads its files, so only once the file is valid, and only
        for the models a job's lines name (a server's others are not read for its batch)."""
        if model not in self._fingerprints:
            self._fingerprints[model] = engine_fingerprint(self.options[model])
        return self._fingerprints[model]

    @property
    def fingerprints(self) -> list[str | None]:
        return [self.fingerprint(model) for model in range(len(self.models))]

    def model_of(self, name: str | None) -> int:
        """The index of the model a (valid) line names."""
        return self._index[name]

    def limits(self, limits: Limits) -> Limits:
        """limits with the models' vocabulary when they share one (else token ids are checked by the engine)."""
        if limits.vocab_size is not None:
            return limits
        sizes = {vocabulary_size(options.get("model")) for options in self.options}
        return dataclasses.replace(limits, vocab_size=sizes.pop()) if len(sizes) == 1 else limits

    def group(self, shard_dir, num_shards: int, shard_size: int) -> tuple[list[int], list[dict]]:
        """Regroup the job's shards by model: (their sizes, each one's engine for its ledger row)."""
        sizes, models = group_by_model(shard_dir, num_shards, self.model_of, len(self.models), shard_size)
        return sizes, [self.shard_engine(model) for model in models]

    def named(self, shard_engines: list[dict]) -> list[int]:
        """The indexes of the models whose lines the grouped shards hold, in --model order."""
        keys = {engine["engine_key"] for engine in shard_engines}
        return [index for index, key in enumerate(self.keys) if key in keys]

    def only(self, indexes: list[int]) -> "SeveralEngines":
        """These of the models (a server's narrowed to those a batch's lines name), fingerprints kept."""
        narrowed = SeveralEngines([(self.models[i], self.options[i]) for i in indexes],
                                  tuple(f"{alias}={self.models[i]}" for i in indexes for alias in self.served_names[i]))
        narrowed._fingerprints = {j: self._fingerprints[i] for j, i in enumerate(indexes) if i in self._fingerprints}
        return narrowed

    def shard_engine(self, model: int) -> dict:
        return {"engine_key": self.keys[model], "engine_options": self.options[model],
                "engine_fingerprint": self.fingerprint(model)}

    def ledger_models(self) -> list[dict]:
        """jobs.models: each model as given, with its engine options, key and fingerprint (and its
        served names, where it was given some)."""
        return [{"model": name, "engine_options": options, "engine_key": key, "engine_fingerprint": fingerprint,
                 **({"served_names": served} if served else {})}
                for name, options, key, fingerprint, served in zip(self.models, self.options, self.keys,
                                                                   self.fingerprints, self.served_names)]

    @classmethod
    def of_job(cls, job) -> "SeveralEngines | None":
        """The models of an existing job (a retry's), fingerprinted afresh; None for a one-model job."""
        if job.models is None:
            return None
        return cls([(m["model"], m["engine_options"]) for m in job.models],
                   tuple(f"{alias}={m['model']}" for m in job.models for alias in m.get("served_names", ())))


class ShardJob:
    """A job as one of its shards runs it: a several-model job's shard has its own engine (options,
    fingerprint, key, model), every other attribute is the job's. A one-model job's shard (its
    engine columns null) is the job itself: shard_job returns the job then."""

    def __init__(self, job, shard):
        self._job = job
        self.engine_options = shard.engine_options
        self.engine_fingerprint = shard.engine_fingerprint
        self.engine_key = shard.engine_key
        self.model = shard.engine_options.get("model", job.model)

    def __getattr__(self, name):
        return getattr(self._job, name)


def shard_job(job, shard):
    """The job with the shard's engine fields where it has them (workers.shard_runner, reuse keys)."""
    return job if job is None or shard is None or shard.engine_options is None else ShardJob(job, shard)


def by_engine_key(job, shards, indexes: list[int]) -> dict[str, list[int]]:
    """indexes (of shards, the job's ledger rows) by the engine key each runs on, in order: its
    own (a several-model job's shard), else the job's."""
    key_of = {shard.index: shard.engine_key or job.engine_key for shard in shards}
    groups: dict[str, list[int]] = {}
    for index in indexes:
        groups.setdefault(key_of[index], []).append(index)
    return groups
