"""`pipeline submit FILE --dry-run`: what a job would do, said before the night, creating nothing.

One streaming pass over the file (bounded memory whatever its size): every line validated
as a submit would, its prompt tokenized as the engine would (pipeline.prompts), its key
looked up among the stored answers (in batches, as the shards would), and the figures
summed. The ledger is only read, and only when it exists: a dry run creates no database,
job, shard or message.

The duration is estimated by jobs.duration_estimate: measured on the job's engine where it
is built here (`pipeline run`), else from the throughput of the engine's recent jobs.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from jobs import ledger
from jobs.input.line_checks import Scan
from jobs.input.request_spec import RequestSpec
from jobs.input.validation import InvalidInput, Limits
from jobs.ledger.models import Job
from jobs.paths import JobPaths
from jobs.reuse.answer_key import engine_fingerprint, request_key
from jobs.duration_estimate import AnswerLengths, Work, measure_step_costs
from jobs.ledger.statuses import JobStatus
from jobs.submission import check_model_can_answer, with_vocabulary
from pipeline.engine.scheduler import length_error
from pipeline.engine_key import engine_key
from pipeline.models.model_dir import context_length, is_encoder

HISTORY_JOBS = 5     # the recent jobs whose throughput (and answers' lengths) make the estimate
_LOOKUP_BATCH = 1000


@dataclass
class DryRun:
    lines: int                     # requests in the file
    rows: int                      # result rows they would make (choices, embedding inputs)
    prompt_tokens: int             # in all (each request's prompt once; every embedding input)
    max_prompt_tokens: int
    context_length: int            # the model's context (max_model_len applied)
    # What the KV cache of the engine these options build here holds (`pipeline run` on a
    # CPU, or num_kv_blocks and block_size given); None where only the engine can tell: a
    # worker's engine has its own options, a GPU's cache takes what the loaded model leaves.
    kv_cache_tokens: int | None
    max_model_len: int             # the engine's real limit: the least of the two known
    over_context: int              # requests the engine refuses as too long (Scheduler.admission_error's rule)
    untokenizable: int             # requests whose prompt cannot be made (a chat template refuses it): they fail alone
    first_untokenizable: str | None   # "line N: why", for the first of them
    reused: int                    # requests an earlier job's stored answer would answer
    output_token_ceiling: int      # the sum of max_tokens over every choice (0 for embeddings)
    expected_output_tokens: int    # of the answers to compute: the ceiling, less what history says ends early
    engine_key: str
    throughput_tok_s: float | None  # the median total tok/s of recent jobs of this engine; None: no history
    history_jobs: int
    history_answers: int           # recent answers whose lengths stand for the expected ones
    estimated_s: float | None
    estimate_basis: str | None     # "measured here" (the engine built and timed), "history", or None

    def as_dict(self) -> dict:
        return asdict(self)


def dry_run(path, *, engine_options: dict, model_names, limits: Limits = Limits(),
            database_url: str | None, root, reuse: bool = True, engine_here: bool = False, columns=None,
            only=None) -> DryRun:
    """The figures of a dry run of `path`; InvalidInput (every bad line) as a submit would.
    engine_here: the job's engine is built here from engine_options (`pipeline run`), so
    its KV cache's size can be known before it exists. columns: a Parquet table's columns that
    make its lines (jobs.input.request_source.TableColumns). only: which model's lines are counted
    (a line's model name -> bool: a job of several models has a dry run per model, each of the
    whole file's lines validated); None: every line."""
    from pipeline.models.loader import load_tokenizer, resolve_model_dir   # transformers: only here

    model_dir = resolve_model_dir(engine_options.get("model"))
    tokenizer = load_tokenizer(model_dir)
    context = context_length(model_dir, engine_options.get("max_model_len"))
    encoder = is_encoder(model_dir)
    cache = kv_cache_tokens(engine_options, model_dir) if engine_here and not encoder else None
    too_long = _too_long_rule(context, cache, encoder)
    key = engine_key(engine_options)
    fingerprint = engine_fingerprint(engine_options)
    Session = _existing_ledger(database_url)
    totals = dict(lines=0, rows=0, prompt_tokens=0, max_prompt_tokens=0, over_context=0, untokenizable=0,
                  first_untokenizable=None, reused=0, output_token_ceiling=0)
    work = Work()   # what is left to compute, engine request by engine request
    pending: list[tuple[str, list]] = []   # (key, its engine requests) of requests awaiting their lookup

    def look_up():
        found = _stored_keys(Session, root, [k for k, _ in pending]) if reuse and Session is not None else set()
        for k, parts in pending:
            if k in found:
                totals["reused"] += 1
            else:
                work.add(parts)
        pending.clear()

    scan = Scan(path, with_vocabulary(limits, engine_options), model=model_names, columns=columns)
    for line in scan:
        if only is not None and not only(line.get("model")):
            continue
        request = RequestSpec.from_dict(line)
        # (an encoder cannot take a generation line: the file is refused below, untokenized)
        totals["lines"] += 1
        totals["rows"] += request.num_rows
        try:
            lengths = _prompt_lengths(tokenizer, request) if request.is_embedding or not encoder else [0]
        except Exception as e:   # the engine fails such a request alone, with this reason
            totals["untokenizable"] += 1
            totals["first_untokenizable"] = totals["first_untokenizable"] or f"line {request.line}: {e}"
            continue
        prompt = sum(lengths)
        ceiling = 0 if request.is_embedding else request.max_tokens * request.num_rows
        totals["prompt_tokens"] += prompt
        totals["max_prompt_tokens"] = max(totals["max_prompt_tokens"], *lengths)
        totals["over_context"] += any(too_long(n, request) for n in lengths)
        totals["output_token_ceiling"] += ceiling
        # (prompt tokens, answer's ceiling, answers) of each engine request that runs
        parts = [(n, 0, 0) if request.is_embedding else (n, min(request.max_tokens, context - n), request.n)
                 for n in lengths if not too_long(n, request)]
        line_key = request_key(line, fingerprint)
        if line_key is None:
            work.add(parts)
        else:
            pending.append((line_key, parts))
            if len(pending) >= _LOOKUP_BATCH:
                look_up()
    if not scan.validation.ok:
        raise InvalidInput(scan.validation)
    check_model_can_answer(scan.validation, engine_options.get("model"))
    look_up()
    recent = _recent_jobs(Session, key)
    rates = [job.total_tok_s for job in recent]
    rate = statistics.median(rates) if rates else None
    answer_lengths = AnswerLengths.of(recent)
    expected = work.expected_output_tokens(answer_lengths)
    estimated, basis = None, None
    costs = measure_step_costs(engine_options, work) if engine_here and not encoder and work.prompts else None
    if costs is not None:
        estimated, basis = work.seconds(costs, answer_lengths), "measured here"
    elif rate:
        estimated, basis = (work.prompt_tokens + expected) / rate, "history"
    return DryRun(**totals, context_length=context, kv_cache_tokens=cache,
                  max_model_len=context if cache is None else min(context, cache),
                  expected_output_tokens=round(expected), engine_key=key, throughput_tok_s=rate,
                  history_jobs=len(rates), history_answers=answer_lengths.count, estimated_s=estimated,
                  estimate_basis=basis)


def _too_long_rule(context: int, cache: int | None, encoder: bool):
    """too_long(prompt_tokens, request): whether the engine refuses that prompt of the
    request (pipeline.engine.scheduler.Scheduler.admission_error, and the encoder's limit)."""
    if encoder:   # an encoder takes inputs of the whole context
        return lambda n, request: n > context
    return lambda n, request: length_error(n, request.max_tokens, request.is_embedding, context, cache) is not None


def kv_cache_tokens(engine_options: dict, model_dir) -> int | None:
    """The tokens the KV cache of an engine built here from engine_options holds, from the
    plan Engine.__init__ builds its cache from (memory_budget.kv_cache_plan), without
    loading the model; None where only the engine can
    tell: on CUDA its budget is what the loaded model leaves of the device, and its block
    size the probed attention backend's (unless num_kv_blocks and block_size are given)."""
    from pipeline.config import EngineConfig
    from pipeline.device import resolve_device, resolve_dtype
    from pipeline.engine import memory_budget
    from pipeline.models.llama import LlamaArgs
    from pipeline.models.loader import read_hf_config

    config = EngineConfig(**engine_options)
    if config.num_kv_blocks and config.block_size:
        return config.num_kv_blocks * config.block_size
    try:
        device = resolve_device(config.device)
        if device.type == "cuda":
            return None
        hf_config = read_hf_config(model_dir)
        args = LlamaArgs.from_hf_config(hf_config)
        dtype = resolve_dtype(config.dtype, device, hf_config)
        plan = memory_budget.kv_cache_plan(config, device, args, dtype, memory_budget.max_num_seqs(config, device))
    except (RuntimeError, ValueError):   # an engine that would not start: it says why when it does not
        return None
    return plan.num_tokens


def _prompt_lengths(tokenizer, request) -> list[int]:
    """The tokens of each of a request's prompts: one, its list of prompts, or an embedding
    request's inputs."""
    from pipeline.prompts import prompt_token_ids
    items = request.input if request.is_embedding else request.prompts
    if items is not None:
        return [len(item) if isinstance(item, list) else len(prompt_token_ids(tokenizer, prompt=item))
                for item in items]
    return [len(prompt_token_ids(tokenizer, prompt=request.prompt, messages=request.messages, tools=request.tools,
                                 reasoning_effort=request.reasoning_effort))]


def _existing_ledger(database_url: str | None):
    """Sessions on the ledger if it exists (a SQLite file that is not there is not made)."""
    if not database_url:
        return None
    if database_url.startswith("sqlite:///") and not Path(database_url.removeprefix("sqlite:///")).exists():
        return None
    return ledger.session_factory(ledger.make_engine(database_url))


def _stored_keys(Session, root, keys: list[str]) -> set[str]:
    """The keys with a stored answer whose result file is still there."""
    try:
        with Session() as s:
            found = ledger.find_answers(s, keys, exclude_job="")
    except SQLAlchemyError:   # a ledger from before the index: nothing stored
        return set()
    return {k for k, places in found.items()
            if any(JobPaths(root, job).result_shard(shard).exists() for job, shard, _ in places)}


def _recent_jobs(Session, key: str) -> list[Job]:
    """The last completed jobs of the engine key that computed something (a throughput)."""
    if Session is None:
        return []
    try:
        with Session() as s:
            return list(s.scalars(select(Job)
                                  .where(Job.engine_key == key, Job.status == JobStatus.COMPLETED,
                                         Job.total_tok_s.is_not(None))
                                  .order_by(Job.finished_at.desc()).limit(HISTORY_JOBS)))
    except SQLAlchemyError:
        return []
