"""RequestSpec: one validated, normalised request, and its shard-file line (docs/contracts.md).

Its sampling settings are SamplingParams' own fields (pipeline.sampling_params, their one
declaration), taken by name with their defaults: a new sampling option is a field there, its
input check (jobs.input.field_checks.SAMPLING_CHECKS) and the sampler's code; RequestSpec, its
shard line and the engine request made of it (workers.shard_runner) follow by themselves.
"""
from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from operator import attrgetter

from pipeline.sampling_params import SamplingParams

# SamplingParams' fields that no input line gives: the engine's own (echo asks for prompt_logprobs).
ENGINE_ONLY = frozenset({"stop_token_ids", "prompt_logprobs"})
SAMPLING_FIELDS: tuple[Field, ...] = tuple(f for f in fields(SamplingParams) if f.name not in ENGINE_ONLY)
# The settings every shard line has carried from the first, written whatever their value (they
# are in the answer key of every line: jobs.reuse.answer_key); every other field with a default
# only when it differs from it, so lines stay short and older ones read the same.
ALWAYS_WRITTEN = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
                  "ignore_eos")


def _with_sampling_fields(cls):
    """cls with SAMPLING_FIELDS (their types and defaults) among its fields, after `messages`,
    for dataclass to make."""
    own = list(cls.__annotations__.items())
    at = [name for name, _ in own].index("messages") + 1
    cls.__annotations__ = dict([*own[:at], *((f.name, f.type) for f in SAMPLING_FIELDS), *own[at:]])
    for f in SAMPLING_FIELDS:
        setattr(cls, f.name, field(default=f.default, default_factory=f.default_factory))
    return cls


@dataclass(slots=True)
@_with_sampling_fields
class RequestSpec:
    """One validated, normalised request (defaults filled in)."""
    id: str
    line: int
    prompt: str | None
    messages: list[dict] | None
    # Here: SamplingParams' settings, SAMPLING_FIELDS (max_tokens, temperature, ..., logit_bias,
    # structured_output, logprobs, n), with its defaults. logit_bias keeps its token ids as
    # strings (JSON's); n is also an embedding request's number of inputs.
    model: str | None = None
    timeout_s: float | None = None   # seconds it may run once started (None: the job's, if any)
    tools: list[dict] | None = None          # a chat request's tools, for its chat template
    tool_call: str | None = None             # the function whose arguments the answer is (forced)
    reasoning_effort: str | None = None      # a chat request's, for its chat template (None: the template's default)
    echo: bool = False                       # completions: the answer's text starts with the prompt
    # Completions given a list `prompt` (OpenAI's): its texts or token-id lists, n answers to
    # each, result row `choice` = i * n + j as OpenAI numbers them; prompt is None.
    prompts: list | None = None
    # An embedding request (jobs.input.embedding_checks): its texts or token-id lists, one vector
    # (result row, `choice` = its index) each; prompt and messages are None, n = len(input).
    input: list | None = None
    dimensions: int | None = None            # keep the vectors' first this many components
    encoding_format: str | None = None       # "base64": OpenAI output gives float32 bytes in base64
    key: str | None = None                   # its answer's identity (jobs.reuse.answer_key); None: not deterministic

    @property
    def is_embedding(self) -> bool:
        return self.input is not None

    @property
    def num_rows(self) -> int:
        """Its result rows: (id, choice) for choice in range(num_rows)."""
        return self.n * len(self.prompts) if self.prompts is not None else self.n

    def prompt_index(self, choice: int) -> int | None:
        """Which of its prompts row `choice` answers (None: it has one prompt)."""
        return None if self.prompts is None else choice // self.n

    def to_dict(self) -> dict:
        """The shard-file line of docs/contracts.md (request_line)."""
        return request_line(dict(zip(_SPEC_FIELDS, _values(self))))

    @classmethod
    def from_dict(cls, d: dict) -> "RequestSpec":
        return cls(**d)


_SPEC_FIELDS = tuple(f.name for f in fields(RequestSpec))
_values = attrgetter(*_SPEC_FIELDS)   # every field at once, in C
# Written only when they differ from these defaults (every field with one, but ALWAYS_WRITTEN).
OPTIONAL_FIELDS = {f.name: f.default if f.default_factory is MISSING else f.default_factory()
                   for f in fields(RequestSpec)
                   if (f.default is not MISSING or f.default_factory is not MISSING) and f.name not in ALWAYS_WRITTEN}


def request_line(fields: dict, optional: tuple[tuple[str, object], ...] | None = None) -> dict:
    """A request's shard-file line from its fields (every required one; optional ones may be
    left out): the OPTIONAL_FIELDS only when they differ from their defaults, so lines stay
    short and older ones read the same. What input validation yields for each valid line
    (jobs.input.line_checks.Scan: a dict costs a fraction of a RequestSpec made and then turned into one);
    RequestSpec.from_dict makes the request of it. optional: the (field, default) pairs to
    look at when only those can be there (None: every optional field). `fields` itself
    becomes the line."""
    for name, default in optional or _OPTIONAL_ITEMS:
        if fields.get(name, default) == default:
            fields.pop(name, None)
    return fields


_OPTIONAL_ITEMS = tuple(OPTIONAL_FIELDS.items())
