"""`pipeline submit FILE --dry-run`: what a job would do, said before the night, creating nothing.

One streaming pass over the file (bounded memory whatever its size): every line validated
as a submit would, its prompt tokenized as the engine would (pipeline.prompts), its key
looked up among the stored answers (in batches, as the shards would), and the figures
summed. The estimate divides the tokens left to compute (prompts not reused, plus the
output-token ceiling) by the median throughput of the last completed jobs of the same
engine key in the ledger; with no such job it says there is no history. The ledger is only
read, and only when it exists: a dry run creates no database, job, shard or message.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from jobs import ledger, spec
from jobs.ledger.models import Job
from jobs.paths import JobPaths
from jobs.request_key import engine_fingerprint, request_key
from jobs.states import JobStatus
from pipeline.engine_key import engine_key
from jobs.submission import check_model_can_answer
from pipeline.models.model_dir import context_length, is_encoder

HISTORY_JOBS = 5     # the recent jobs whose throughput makes the estimate
_LOOKUP_BATCH = 1000


@dataclass
class DryRun:
    lines: int                     # requests in the file
    rows: int                      # result rows they would make (choices, embedding inputs)
    prompt_tokens: int             # in all (each request's prompt once; every embedding input)
    max_prompt_tokens: int
    context_length: int
    over_context: int              # requests with a prompt (or an input) too long for the model
    untokenizable: int             # requests whose prompt cannot be made (a chat template refuses it): they fail alone
    first_untokenizable: str | None   # "line N: why", for the first of them
    reused: int                    # requests an earlier job's stored answer would answer
    output_token_ceiling: int      # the sum of max_tokens over every choice (0 for embeddings)
    engine_key: str
    throughput_tok_s: float | None  # the median total tok/s of recent jobs of this engine; None: no history
    history_jobs: int
    estimated_s: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def dry_run(path, *, engine_options: dict, model_names, limits: spec.Limits = spec.Limits(),
            database_url: str | None, root, reuse: bool = True) -> DryRun:
    """The figures of a dry run of `path`; spec.InvalidInput (every bad line) as a submit would."""
    from pipeline.models.loader import load_tokenizer, resolve_model_dir   # transformers: only here

    model_dir = resolve_model_dir(engine_options.get("model"))
    tokenizer = load_tokenizer(model_dir)
    context = context_length(model_dir, engine_options.get("max_model_len"))
    # A decoder needs room for one output token after the prompt (an embedding's too: the engine's
    # admission rule); an encoder takes inputs of the whole context.
    encoder = is_encoder(model_dir)
    longest = context if encoder else context - 1
    key = engine_key(engine_options)
    fingerprint = engine_fingerprint(engine_options)
    Session = _existing_ledger(database_url)
    totals = dict(lines=0, rows=0, prompt_tokens=0, max_prompt_tokens=0, over_context=0, untokenizable=0,
                  first_untokenizable=None, reused=0, output_token_ceiling=0)
    computed_tokens = 0
    pending: list[tuple[str, int]] = []   # (key, tokens to compute) of requests awaiting their lookup

    def look_up():
        nonlocal computed_tokens
        found = _stored_keys(Session, root, [k for k, _ in pending]) if reuse and Session is not None else set()
        for k, tokens in pending:
            if k in found:
                totals["reused"] += 1
            else:
                computed_tokens += tokens
        pending.clear()

    scan = spec.Scan(path, limits, model=model_names)
    for line in scan:
        request = spec.RequestSpec.from_dict(line)
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
        totals["over_context"] += max(lengths) > longest
        totals["output_token_ceiling"] += ceiling
        line_key = request_key(line, fingerprint)
        if line_key is None:
            computed_tokens += prompt + ceiling
        else:
            pending.append((line_key, prompt + ceiling))
            if len(pending) >= _LOOKUP_BATCH:
                look_up()
    if not scan.validation.ok:
        raise spec.InvalidInput(scan.validation)
    check_model_can_answer(scan.validation, engine_options.get("model"))
    look_up()
    rates = _recent_throughput(Session, key)
    rate = statistics.median(rates) if rates else None
    return DryRun(**totals, context_length=context, engine_key=key, throughput_tok_s=rate, history_jobs=len(rates),
                  estimated_s=computed_tokens / rate if rate else None)


def _prompt_lengths(tokenizer, request) -> list[int]:
    """The tokens of each of a request's prompts: one, its list of prompts, or an embedding
    request's inputs."""
    from pipeline.prompts import prompt_token_ids
    items = request.input if request.is_embedding else request.prompts
    if items is not None:
        return [len(item) if isinstance(item, list) else len(prompt_token_ids(tokenizer, prompt=item))
                for item in items]
    return [len(prompt_token_ids(tokenizer, prompt=request.prompt, messages=request.messages, tools=request.tools))]


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


def _recent_throughput(Session, key: str) -> list[float]:
    if Session is None:
        return []
    try:
        with Session() as s:
            rates = list(s.scalars(select(Job.total_tok_s)
                                   .where(Job.engine_key == key, Job.status == JobStatus.COMPLETED,
                                          Job.total_tok_s.is_not(None))
                                   .order_by(Job.finished_at.desc()).limit(HISTORY_JOBS)))
    except SQLAlchemyError:
        return []
    return rates
