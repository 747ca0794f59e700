"""RequestSpec: one validated, normalised request, and its shard-file line (docs/contracts.md)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter


@dataclass(slots=True)
class RequestSpec:
    """One validated, normalised request (defaults filled in)."""
    id: str
    line: int
    prompt: str | None
    messages: list[dict] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: list[str]
    ignore_eos: bool
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None   # token id (a string, as in JSON) -> bias
    model: str | None = None
    timeout_s: float | None = None   # seconds it may run once started (None: the job's, if any)
    structured_output: dict | None = None   # the grammar of the answer (pipeline.structured_output)
    tools: list[dict] | None = None          # a chat request's tools, for its chat template
    tool_call: str | None = None             # the function whose arguments the answer is (forced)
    logprobs: int | None = None              # top alternatives with each token's logprob (None: no logprobs)
    n: int = 1                               # answers wanted (to each prompt), or an embedding request's inputs
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
# Written only when they differ from these defaults: shard lines stay short, and older ones read the same.
OPTIONAL_FIELDS = {"model": None, "timeout_s": None, "structured_output": None, "tools": None, "tool_call": None,
                    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None, "logprobs": None,
                    "n": 1, "echo": False, "prompts": None, "input": None, "dimensions": None, "encoding_format": None,
                    "key": None}


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
