"""Option bundles shared by the commands: the deployment's settings, and the engine's options.

Settings options take their variable and default from jobs.settings.Settings and fill
click's context object; the command gets the finished Settings as `settings`. Engine
options are made from the fields of EngineConfig, so a new field is a new option.
"""
from __future__ import annotations

import functools
import math
from dataclasses import MISSING, fields
from pathlib import Path

import click

from jobs.settings import LOG_FORMATS, Settings, auto_or_count, default, env_var
from pipeline.config import (ATTENTION_BACKENDS, DEVICES, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS,
                             SPECULATIVE_METHODS, EngineConfig)

class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (1e400 reads as inf): a range check
    alone lets nan through, and a timeout of nan never fires."""
    name = "finite float"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


class AutoOrCount(click.ParamType):
    """An option that is "auto" or a whole number >= minimum (jobs.settings.auto_or_count):
    --tokenizer-processes, --shard-size."""
    name = "auto|N"

    def __init__(self, minimum: int):
        self.minimum = minimum

    def convert(self, value, param, ctx):
        try:
            return auto_or_count(value, self.minimum, "the option")   # (its own message below)
        except ValueError:
            self.fail(f'{value!r} is neither "auto" nor a whole number >= {self.minimum}', param, ctx)


_SETTING_OPTIONS = {
    "data_dir": dict(decls=("--data-dir",), type=click.Path(file_okay=False), show_default=True,
                     help="Where job inputs and results live."),
    "database_url": dict(decls=("--database-url",), metavar="URL",
                         help="SQLAlchemy URL of the job ledger  [default: SQLite in the data dir]"),
    "broker_url": dict(decls=("--broker-url",), show_default=True),
    "max_attempts": dict(decls=("--max-attempts",), type=click.IntRange(min=1), show_default=True,
                         help="Attempts a shard gets (as the workers': PIPELINE_MAX_ATTEMPTS)."),
    "shards_in_flight": dict(decls=("--shards-in-flight",), type=click.IntRange(min=1), show_default=True,
                             help="Most shards one engine runs at once, sharing its batches (each starts "
                                  "once the batch has room), so that it never runs dry between shards."),
    "tokenizer_processes": dict(decls=("--tokenizer-processes",), type=AutoOrCount(0), show_default=True,
                                help="Processes that render and encode the next prompts beside the engine (for a "
                                     "host feeding a fast GPU short requests); 0: the engine's thread does; "
                                     "auto: one for an engine on a CUDA GPU, none on a CPU."),
    "metrics_port": dict(decls=("--metrics-port",), type=click.IntRange(0, 65535), metavar="PORT",
                         help="Serve Prometheus metrics at http://<host>:PORT/metrics while it runs  [default: off]"),
    "log_format": dict(decls=("--log-format",), type=click.Choice(LOG_FORMATS), show_default=True,
                       help="json: one JSON object a line; records about a shard carry its job_id, shard, "
                            "attempt and worker."),
    "max_upload_bytes": dict(decls=("--max-upload-bytes",), type=click.IntRange(min=1), show_default=True,
                             help="Largest upload `pipeline serve` accepts; a bigger one is refused (413) "
                                  "and nothing of it is kept."),
    "max_queued_requests": dict(decls=("--max-queued-requests",), type=click.IntRange(min=0), show_default=True,
                                help="Refuse a job that would put more requests than this in the queue "
                                     "(queued shards of live jobs; 0: no limit)."),
    "cost_per_hour": dict(decls=("--cost-per-hour",), type=FiniteFloat(min=0), metavar="RATE",
                          help="What an hour of this device costs: each shard's cost is its device-seconds x "
                               "RATE / 3600, in the ledger and `pipeline status`  [default: none, no cost]"),
    "queued_grace_s": dict(decls=("--queued-grace",), type=FiniteFloat(min=0), show_default=True,
                           help="Re-enqueue shards queued for longer than this (seconds)."),
}


def table_columns(f):
    """--id-column and --prompt-column: the columns of a Parquet FILE that make each row's id
    and prompt, passed as `columns` (a jobs.input.request_source.TableColumns, None if neither given)."""
    @functools.wraps(f)
    def wrapper(*args, id_column, prompt_column, **kwargs):
        from jobs.input.request_source import TableColumns

        given = id_column is not None or prompt_column is not None
        return f(*args, columns=TableColumns(id_column, prompt_column) if given else None, **kwargs)

    wrapper = click.option("--prompt-column", metavar="NAME",
                           help="A Parquet FILE: the string column that is each row's prompt (rather than a "
                                "messages column or the OpenAI batch columns)  [default: prompt]")(wrapper)
    return click.option("--id-column", metavar="NAME",
                        help="A Parquet FILE: the string column that is each row's id  [default: id; without "
                             "one, row-NNNNNN]")(wrapper)


def _remember(ctx: click.Context, param: click.Parameter, value):
    if value is not None:
        ctx.ensure_object(dict)[param.name] = value


def settings_options(*names: str):
    """--data-dir, --database-url and the named settings' options; the command gets `settings`."""
    def decorator(f):
        @click.pass_context
        @functools.wraps(f)
        def wrapper(ctx: click.Context, *args, **kwargs):
            try:
                ctx.obj = Settings.from_env(**ctx.ensure_object(dict))
            except ValueError as e:   # a malformed PIPELINE_* variable (PIPELINE_KEEP_RESULTS=7x): exit 2
                raise click.UsageError(str(e)) from None
            return f(*args, settings=ctx.obj, **kwargs)

        for name in reversed(("data_dir", "database_url", *names)):
            spec = dict(_SETTING_OPTIONS[name])
            wrapper = click.option(*spec.pop("decls"), name, envvar=env_var(name), default=default(name),
                                   expose_value=False, callback=_remember, **spec)(wrapper)
        return wrapper
    return decorator


# Per-field additions to the option made from an EngineConfig field; "flag" renames a
# bool's on/off pair (e.g. "--prefix-caching/--no-prefix-caching").
_ENGINE_OPTIONS = {
    "model": dict(metavar="DIR", help="Hugging Face model directory  [default: bundled SmolLM2-135M-Instruct]"),
    "dtype": dict(type=click.Choice(DTYPES),
                  help="auto: the model's own dtype where the device computes it natively (CUDA; a CPU "
                       "with AVX-512 BF16 or AMX), else float32; but bfloat16 for a float32 checkpoint on a "
                       "CUDA GPU that has it. float32 for exact comparisons.  [default: auto]"),
    "device": dict(type=click.Choice(DEVICES)),
    "quantization": dict(type=click.Choice(QUANTIZATIONS),
                         help="int8 (LLM.int8), nf4: bitsandbytes (any device). w8a8: CPU only, SmoothQuant, "
                              "then int8 weights and int8 activations per token on fbgemm (oneDNN on CPUs with AMX): "
                              "1.35-2.5x float32's speed (by CPU and workload), perplexity -1.2% to +1.4% on the "
                              "bundled model's fixed text (up to +3.5% on other text). fp8: e4m3 weights and per-token "
                              "activations on FP8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper). "
                              "w8a16: int8 weights (half of bf16's memory). w4a16: int4 weights in groups of 32 "
                              "(tinygemm; 5/16). All three quantize layer by layer while loading, so a model "
                              "that fits only quantized loads; they run on a CPU too, slowly "
                              "(docs/quantization.md)  [default: none]"),
    "kv_cache_gib": dict(help="Memory budget of the KV cache  [default: 1 on a CPU; on CUDA what "
                              "--gpu-memory-utilization leaves once the model is loaded]"),
    "gpu_memory_utilization": dict(type=FiniteFloat(0, 1, min_open=True),
                                   help="CUDA: the share of the GPU's memory the engine may fill (model, "
                                        "activations, KV cache)  [default: 0.9]"),
    "kv_cache_dtype": dict(type=click.Choice(KV_CACHE_DTYPES),
                           help="auto: keys and values in the compute dtype. int8: quantized when "
                                "written (a scale per token and head), so the same --kv-cache-gib "
                                "holds about 2x the blocks of bf16, 3.8x of float32  [default: auto]"),
    "block_size": dict(help="Tokens in one KV-cache block  [default: the attention backend's: 256 for the "
                            "paged varlen of torch >= 2.12, whose FlashAttention-2 paged KV needs a multiple "
                            "of 256; 16 for the packed varlen of torch 2.10/2.11, cpu and reference]"),
    "max_num_seqs": dict(help="Most sequences in one batch  [default: 64 on a CPU, 256 on CUDA]"),
    "max_num_batched_tokens": dict(help="Most tokens in one engine step  [default: 1024 on a CPU, 8192 on CUDA]"),
    "admission_group": dict(help="While sequences decode, admit waiting ones only once this many slots are "
                                 "free (or all that wait fit), so that most steps are plain decodes, which "
                                 "CUDA graphs replay  [default: max-num-seqs / 8 where decode graphs are "
                                 "captured, else 1]"),
    "max_model_len": dict(help="Longest sequence  [default: the model's context length]"),
    "num_kv_blocks": dict(help="KV-cache blocks, instead of the --kv-cache-gib budget."),
    "enable_prefix_caching": dict(flag="--prefix-caching/--no-prefix-caching",
                                  help="Compute a prompt prefix (system prompt, few-shot examples) once and "
                                       "reuse its KV cache across requests, shards and jobs  [default: on]"),
    "pack_weights": dict(help="CPU: keep weights packed once at load, float32 in MKL's layout (about 3x "
                              "the float32 weight memory), bfloat16 in oneDNN's (no extra memory): faster "
                              "decode steps  [default: on]"),
    "speculative": dict(type=click.Choice(SPECULATIVE_METHODS),
                        help="ngram: speculative decoding by prompt lookup: draft the tokens that "
                             "followed the last earlier occurrence of a sequence's latest tokens in its "
                             "own prompt and output, verify them in one pass. Same greedy output, same "
                             "sampling distribution; faster where outputs copy their input  [default: none]"),
    "num_speculative_tokens": dict(help="Most draft tokens per sequence and step (with --speculative)."),
    "attention_backend": dict(type=click.Choice(ATTENTION_BACKENDS),
                              help="cpu: C kernels on a CPU (PyTorch paths elsewhere). varlen: FlashAttention-2 "
                                   "over the paged cache, one call per layer (CUDA, float16/bfloat16). "
                                   "reference: the same in plain PyTorch (slow, for checks). auto: varlen on "
                                   "CUDA where it runs, else cpu  [default: auto]"),
    "cuda_graphs": dict(help="CUDA: replay decode-only steps from graphs captured at bucketed batch "
                             "sizes (ignored on a CPU)  [default: on]"),
    "overlap_steps": dict(help="Launch each step before the previous one's tokens are read back, so that the "
                               "host's scheduling runs while the GPU computes; same greedy and seeded output "
                               "(off with --speculative; a step with prompt logprobs waits)  "
                               "[default: on on CUDA, off on a CPU]"),
    "batch_invariant": dict(flag="--batch-invariance/--no-batch-invariance", envvar="PIPELINE_BATCH_INVARIANCE",
                            help="A greedy or seeded request gets the same tokens and logprobs, bit for bit, "
                                 "whatever shares its batch, however its prompt is chunked, with or without the "
                                 "prefix cache or speculation: the answer kept for reuse is the answer a rerun "
                                 "computes. CPU only for now: on a GPU node give --no-batch-invariance, or set "
                                 "PIPELINE_BATCH_INVARIANCE=false for every command there (docs/gpu.md)  "
                                 "[default: on]"),
}
_SCALARS = {"str": str, "int": int, "float": float}


def _engine_option(field, overrides: dict | None = None):
    extra = {**_ENGINE_OPTIONS.get(field.name, {}), **(overrides or {})}
    dashed = field.name.replace("_", "-")
    base = field.type.split("|")[0].strip()  # "int | None" -> "int" (annotations are strings here)
    if base == "bool":
        flag = extra.pop("flag", f"--{dashed}/--no-{dashed}")
        return click.option(flag, field.name, default=None, **extra)
    extra.setdefault("type", _SCALARS[base])
    return click.option(f"--{dashed}", field.name, **extra)


def engine_options(f):
    """An option per EngineConfig field, passed as `engine_options`: a dict of the fields given.

    Nothing given means the EngineConfig default, so a job records only what was asked for.
    """
    names = [field.name for field in fields(EngineConfig)]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        opts = _checked({name: value for name in names if (value := kwargs.pop(name)) is not None})
        return f(*args, engine_options=opts, **kwargs)

    return _with_engine_options(wrapper)


def job_engine_options(f):
    """engine_options for a job (`pipeline submit`, `pipeline run`): --model may be given several
    times, a job of several models (each line names its own: docs/input-format.md), the other options
    applying to each. Passes `engine_options` (the first model's, or none given: as engine_options)
    and `several_models`: the option dicts of each model when there are several, else None."""
    names = [field.name for field in fields(EngineConfig)]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        models = kwargs.pop("model")
        shared = {name: kwargs.pop(name) for name in names if name != "model"}

        def options(model) -> dict:   # in the fields' order, as one --model's always were
            return _checked({name: value for name in names
                             if (value := model if name == "model" else shared[name]) is not None})

        each = [options(model) for model in models] or [options(None)]
        if len({options.get("model") for options in each}) < len(each):
            raise click.UsageError("--model names the same model twice")
        return f(*args, engine_options=each[0], several_models=each if len(each) > 1 else None, **kwargs)

    return _with_engine_options(wrapper, model=dict(
        multiple=True, metavar="DIR", help="Hugging Face model directory (repeatable: a job of several models, "
                                            "each line naming its own; the other options apply to each)  "
                                            "[default: bundled SmolLM2-135M-Instruct]"))


def served_engine_options(f):
    """engine_options for a worker: --model may be given several times (one engine each, the
    other options shared), passed as `served_engines`, a list of option dicts ([] if none given)."""
    names = [field.name for field in fields(EngineConfig) if field.name != "model"]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        models = kwargs.pop("model")
        shared = {name: value for name in names if (value := kwargs.pop(name)) is not None}
        served = [_checked({**shared, "model": model}) for model in models] or ([_checked(shared)] if shared else [])
        return f(*args, served_engines=served, **kwargs)

    return _with_engine_options(wrapper, model=dict(
        multiple=True, help="A Hugging Face model directory to serve (repeatable: one engine at a time, "
                            "each with the other options)  [default: bundled SmolLM2-135M-Instruct]"))


def _checked(opts: dict) -> dict:
    if "model" in opts and Path(opts["model"]).exists():
        opts["model"] = str(Path(opts["model"]).resolve())  # workers may run elsewhere
    try:
        EngineConfig(**opts)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return opts


def _with_engine_options(wrapper, **overrides):
    for field in reversed(fields(EngineConfig)):
        assert field.default is not MISSING, f"EngineConfig.{field.name} needs a default to be an option"
        wrapper = _engine_option(field, overrides.get(field.name))(wrapper)
    return wrapper
