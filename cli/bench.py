"""`pipeline bench`: run a workload file through the engine and report throughput in the
same JSON shape as ../shared/bench/peers.py, so the two can be compared line for line."""
from __future__ import annotations

import json
import time

from pipeline.config import EngineConfig
from pipeline.request import FinishReason, Request
from pipeline.sampling_params import SamplingParams


def read_workload(path: str) -> list[Request]:
    """Lines as written by shared/bench/workload.py: id, prompt, max_tokens, temperature, ignore_eos;
    optionally logprobs, structured_output and n (to measure what they cost)."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if "prompt" not in row:   # an OpenAI batch line, for one: name what bench reads
                    raise ValueError('no "prompt": bench reads the lines ../shared/bench/workload.py writes '
                                     '(id, prompt, max_tokens, temperature, ignore_eos); `pipeline run` takes '
                                     'any input file')
                params = SamplingParams(max_tokens=row.get("max_tokens", 256),
                                        temperature=row.get("temperature", 0.0),
                                        ignore_eos=row.get("ignore_eos", False), logprobs=row.get("logprobs"),
                                        structured_output=row.get("structured_output"), n=row.get("n", 1))
                requests.append(Request(str(row.get("id", line_no)), prompt=row["prompt"], params=params))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}, line {line_no}: {e}") from None
    return requests


def run_bench(path: str, config: EngineConfig) -> dict:
    from pipeline.engine.engine import Engine

    requests = read_workload(path)
    engine = Engine(config)
    # Warm-up (not timed): one short request, as the peers do.
    warm = requests[0]
    list(engine.generate([Request("warm-up", prompt=warm.prompt, params=SamplingParams(max_tokens=2, temperature=0))]))
    engine.reset_prefix_cache()   # the timed run starts cold, as a new job's first shard does
    engine.block_manager.reset_peak()
    steps, overlapped = engine.num_steps, engine.num_overlapped_steps
    start = time.perf_counter()
    outputs = list(engine.generate(requests))
    seconds = time.perf_counter() - start
    errors = [o for o in outputs if o.finish_reason == FinishReason.ERROR]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0].id}: {errors[0].error}")
    prompt_tokens = sum(o.prompt_tokens for o in outputs)
    output_tokens = sum(o.output_tokens for o in outputs)
    cached_tokens = sum(o.cached_tokens for o in outputs)
    draft_tokens = sum(o.draft_tokens for o in outputs)
    accepted_tokens = sum(o.accepted_tokens for o in outputs)
    return {"engine": "pipeline", "requests": len(outputs), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "seconds": round(seconds, 3),
            "output_tok_s": round(output_tokens / seconds, 2),
            "total_tok_s": round((output_tokens + prompt_tokens) / seconds, 2),
            "cached_tokens": cached_tokens,
            "prefill_tokens_computed": prompt_tokens - cached_tokens,   # per choice: n > 1 shares its prompt
            "prefix_hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
            "kv_blocks": engine.block_manager.num_blocks,
            "kv_peak_utilization": round(engine.block_manager.peak_utilization, 4),
            "draft_tokens": draft_tokens, "accepted_tokens": accepted_tokens,
            "acceptance_rate": round(accepted_tokens / draft_tokens, 4) if draft_tokens else 0.0,
            "steps": engine.num_steps - steps, "overlapped_steps": engine.num_overlapped_steps - overlapped}
