"""gpu_check.py's speed lines: the engine's output tok/s on a random Llama model against
the HBM roofline of its decode, and Hugging Face continuous batching on the same model.

Roofline: decode is memory-bound, so each step of n sequences reads at least the weights
(once: a tied LM head counted once) and every sequence's keys and values so far. With all
n sequences decoding together from prompt P to P + T tokens, step t reads
W + n * (P + t + 1) * kv_bytes_per_token, and the T steps at `bandwidth` bound the output
rate at n * T / (sum of those bytes / bandwidth). Prefill and host time are ignored (it is
a ceiling), so the fraction measured against it is conservative. 4.3 TB/s is the device
copy bandwidth measured on the H200 these checks run on (bytes read and written).
"""
from __future__ import annotations

import gc
import random
import time

import torch

import gpu_models
from gpu_models import VOCAB, parameter_bytes
from gpu_report import BudgetExceeded, report
from pipeline import Engine, EngineConfig, Request, SamplingParams

HBM_BYTES_S = 4.3e12
ROOFLINE_TARGET, HF_RATIO_TARGET = 0.40, 5.0


def check_speed(run) -> None:
    """gpu_check.py's speed lines (run: its Run). On a CPU a small model, for the code path."""
    if run.device == "cuda":
        shape, (n, prompt_len, output_len) = gpu_models.LLAMA_1B, ((64, 128, 128) if run.quick else (256, 128, 512))
    else:
        shape, (n, prompt_len, output_len) = gpu_models.SMALL_SPEED, ((8, 32, 16) if run.quick else (32, 64, 64))
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    model_dir = gpu_models.build_model(run.tmp / "speed", shape, run.tokenizer, dtype, device=run.device)
    prompts = workload(n, prompt_len)
    reserve = 90 if run.device == "cuda" else 15   # seconds kept for the HF peer (the next check)
    ours = run_pipeline(model_dir, run.device, prompts, output_len, run.deadline - reserve)
    # What gpu_quant.check_throughput runs each quantization mode on, and compares with.
    run.speed = dict(model_dir=model_dir, prompts=prompts, output_len=output_len, ours=ours,
                     model="llama-3.2-1b-shape" if run.device == "cuda" else "small")
    roof = roofline_output_tok_s(ours["weight_bytes"], ours["kv_bytes_per_token"], n, prompt_len, output_len)
    fraction = ours["output_tok_s"] / roof
    gpu = run.device == "cuda"   # the roofline is the H200's HBM: no number for a CPU
    status = ("passed" if fraction >= ROOFLINE_TARGET else "failed") if gpu else "measured"
    report("throughput_pipeline", status, device=run.device, model="llama-3.2-1b-shape" if gpu else "small",
           dtype=str(dtype).removeprefix("torch."), sequences=n, prompt_tokens=prompt_len,
           output_tokens_each=output_len, **ours, roofline_output_tok_s=round(roof, 1) if gpu else None,
           roofline_fraction=round(fraction, 4) if gpu else None, target=ROOFLINE_TARGET, hbm_bytes_s=HBM_BYTES_S)


def check_hf_peer(run) -> None:
    """Hugging Face continuous batching on throughput_pipeline's model and workload, and
    our output tok/s over its (needs throughput_pipeline to have run in this process)."""
    speed = getattr(run, "speed", None)
    if speed is None:
        report("throughput_hf_continuous_batching", "skipped", reason="throughput_pipeline did not run")
        return
    try:
        theirs = run_hf_continuous_batching(speed["model_dir"], run.device, speed["prompts"], speed["output_len"])
    except BudgetExceeded:
        raise
    except Exception as e:
        report("throughput_hf_continuous_batching", "error", error=f"{type(e).__name__}: {e}"[:400])
        return
    report("throughput_hf_continuous_batching", "measured", device=run.device, **theirs)
    ratio = speed["ours"]["output_tok_s"] / theirs["output_tok_s"]
    status = ("passed" if ratio >= HF_RATIO_TARGET else "failed") if run.device == "cuda" else "measured"
    report("throughput_vs_hf_continuous_batching", status, ratio=round(ratio, 2), target=HF_RATIO_TARGET)


def check_step_split(run) -> None:
    """Where a steady decode step's time goes (CUDA only): throughput_pipeline's workload run
    to its middle (each sequence about prompt + output/2 tokens long: the average step),
    then 32 steps' wall time as the engine runs them (overlapped), against the GPU time of
    the step's forward alone (its CUDA graph replayed 32 times on the last step's inputs;
    the LM head and the sampler are outside the graph). Wall time well above the graph's
    is the host's share: what the GPU waits on. Then the graph's kernels by name, from
    CUDA's profiler (graph_kernels). In bf16, and again with fp8 weights where the GPU has
    FP8 tensor cores (decode_step_split_fp8): where fp8's time goes."""
    speed = getattr(run, "speed", None)
    if run.device != "cuda" or speed is None:
        report("decode_step_split", "skipped", reason="CUDA only, after throughput_pipeline")
        return
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    for name, quantization in [("decode_step_split", "none")] + ([("decode_step_split_fp8", "fp8")] if fp8 else []):
        try:
            report(name, "measured", quantization=quantization,
                   **step_split(speed["model_dir"], run.device, speed["prompts"], speed["output_len"], quantization))
        except BudgetExceeded:
            raise
        except Exception as e:   # the fp8 line still runs after a bf16 one that raised
            report(name, "error", error=f"{type(e).__name__}: {e}"[:400])
        free_memory()


def step_split(model_dir, device: str, prompts: list[list[int]], output_len: int, quantization: str) -> dict:
    engine = pipeline_engine(model_dir, device, prompts, output_len, quantization)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", prompt_token_ids=p, params=greedy))
        for _ in range(output_len // 2):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(32):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / 32 * 1e3
        graphs = engine.runner.graphs
        bucket = graphs.bucket(len(prompts)) if graphs is not None else None
        graph_ms, kernels = None, {}
        if bucket in getattr(graphs, "graphs", {}):
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
            for _ in range(32):
                graphs.graphs[bucket].replay()
            last.record()
            last.synchronize()
            graph_ms = first.elapsed_time(last) / 32
            kernels = graph_kernels(graphs.graphs[bucket])
        return dict(sequences=len(prompts), context_tokens=len(prompts[0]) + output_len // 2,
                    step_wall_ms=round(wall_ms, 3), graph_forward_ms=graph_ms and round(graph_ms, 3),
                    wall_over_graph=graph_ms and round(wall_ms / graph_ms, 2), **kernels)
    finally:
        engine.abort([s.request_id for s in engine.scheduler.unfinished()])
        del engine


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int = 8, top: int = 16) -> dict:
    """The kernels one replay of `graph` runs, from CUDA's profiler (which traces a graph's
    kernels one by one): microseconds a replay, all of them and the `top` by time, each as
    [name, launches a replay, microseconds a replay]; empty where the profiler saw none."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.count / replays, e.self_device_time_total / replays)
                      for e in prof.key_averages() if e.self_device_time_total > 0), key=lambda k: -k[2])
    if not kernels:
        return {}
    return dict(kernels_us=round(sum(us for _, _, us in kernels), 1),
                kernel_launches=round(sum(calls for _, calls, _ in kernels)),
                top_kernels=[[name[:90], round(calls, 1), round(us, 1)] for name, calls, us in kernels[:top]])


def check_refill(run) -> None:
    """A long job's steady state: W1-shaped requests (prompts of 16-256 tokens, 8-128 output
    tokens) refilling a full batch, admitted each as soon as a slot frees (admission_group 1)
    and in the engine's default groups, alternating A B A B on one engine: output tok/s and
    the share of steps replayed from CUDA graphs (benchmarks/decode_share.py counts them on a CPU)."""
    cuda = run.device == "cuda"
    requests, seqs = (512 if run.quick else 2048, 256) if cuda else (64 if run.quick else 256, 16)
    speed = getattr(run, "speed", None)   # throughput_pipeline's model, when it ran
    model_dir = speed["model_dir"] if speed else gpu_models.build_model(
        run.tmp / "speed", gpu_models.LLAMA_1B if cuda else gpu_models.SMALL_SPEED, run.tokenizer,
        torch.bfloat16 if cuda else torch.float32, device=run.device)
    engine = Engine(EngineConfig(model=str(model_dir), device=run.device, dtype="bfloat16" if cuda else "float32",
                                 max_model_len=512, max_num_seqs=seqs, kv_cache_gib=16 if cuda else 1,
                                 batch_invariant=False))   # no CUDA kernels for it yet
    try:
        # The engine's default where graphs were captured; a CPU (no graphs) runs the same groups.
        grouped = engine.scheduler.admission_group if engine.runner.graphs is not None else max(1, seqs // 8)
        rounds = []
        for group in (1, grouped, 1, grouped):   # 20 s a round at most: the quantized checks follow
            engine.scheduler.admission_group = group
            rounds.append(dict(admission_group=group, **_refill_round(engine, refill_requests(requests),
                                                                      min(run.deadline, time.monotonic() + 20))))
    finally:
        del engine
        free_memory()
    a, b = [r["output_tok_s"] for r in rounds[0::2]], [r["output_tok_s"] for r in rounds[1::2]]
    report("refill_admission_groups", "measured", device=run.device, requests=requests, sequences=seqs,
           rounds=rounds, grouped_over_each=[round(y / x, 3) for x, y in zip(a, b)])


def check_overlap(run) -> None:
    """Overlapped steps (pipeline/engine/step_in_flight.py) off and on, alternating A B A B on one engine: the same
    greedy batch (every request the same length, so both modes run the same batches) must
    give the same tokens, and the output tok/s of each round shows what overlapping the
    host's work with the GPU's buys."""
    cuda = run.device == "cuda"
    n, prompt_len, output_len = ((64 if run.quick else 256), 128, 128) if cuda else (8, 32, 16)
    speed = getattr(run, "speed", None)   # throughput_pipeline's model, when it ran
    model_dir = speed["model_dir"] if speed else gpu_models.build_model(
        run.tmp / "speed", gpu_models.LLAMA_1B if cuda else gpu_models.SMALL_SPEED, run.tokenizer,
        torch.bfloat16 if cuda else torch.float32, device=run.device)
    engine = Engine(EngineConfig(model=str(model_dir), device=run.device, dtype="bfloat16" if cuda else "float32",
                                 max_model_len=prompt_len + output_len, max_num_seqs=n,
                                 kv_cache_gib=16 if cuda else 1, batch_invariant=False))
    prompts, rounds, tokens = workload(n, prompt_len, seed=1), [], {}
    try:
        for overlap in (False, True, False, True):   # 15 s a round at most
            engine.overlap_steps = overlap
            outputs, seconds, steps = _greedy_round(engine, prompts, output_len, min(run.deadline, time.monotonic() + 15))
            tokens.setdefault(overlap, {o.id: o.token_ids for o in outputs})
            produced = sum(o.output_tokens for o in outputs)
            rounds.append(dict(overlap_steps=overlap, steps=steps, overlapped_steps=engine.num_overlapped_steps,
                               output_tokens=produced, seconds=round(seconds, 3),
                               output_tok_s=round(produced / seconds, 1)))
            engine.num_overlapped_steps = 0
    finally:
        del engine
        free_memory()
    complete = all(len(t) == n for t in tokens.values())
    same = complete and tokens[False] == tokens[True]
    a, b = [r["output_tok_s"] for r in rounds[0::2]], [r["output_tok_s"] for r in rounds[1::2]]
    report("overlapped_steps", "passed" if same else "failed", device=run.device, sequences=n,
           prompt_tokens=prompt_len, output_tokens_each=output_len, same_tokens=same,
           complete_rounds=complete, rounds=rounds, overlapped_over_serial=[round(y / x, 3) for x, y in zip(a, b)])


def _greedy_round(engine: Engine, prompts: list[list[int]], output_len: int, deadline: float) -> tuple:
    """Every prompt queued at once, greedy to exactly output_len tokens, stepped until done or
    the deadline: the finished outputs, the seconds and the steps run (launched)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        if refused := engine.add_request(Request(f"o{i}", prompt_token_ids=prompt, params=params)):
            raise RuntimeError(f"request o{i} refused: {refused[0].error}")
    outputs, steps = [], engine.num_steps
    start = time.monotonic()
    try:
        while engine.has_unfinished_requests and time.monotonic() < deadline:
            outputs.extend(engine.step())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return outputs, time.monotonic() - start, engine.num_steps - steps
    finally:
        engine.abort([s.request_id for s in engine.scheduler.unfinished()])
        engine.reset_prefix_cache()


def refill_requests(n: int, seed: int = 0) -> list[Request]:
    """n greedy requests shaped like W1 (prompts of 16-256 random tokens, 8-128 output tokens,
    EOS off), the same for the same seed: a long job's refill (also benchmarks/decode_share.py)."""
    rng = random.Random(seed)
    return [Request(f"r{i}", prompt_token_ids=[rng.randrange(100, VOCAB) for _ in range(rng.randint(16, 256))],
                    params=SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 128), ignore_eos=True))
            for i in range(n)]


def _refill_round(engine: Engine, requests: list[Request], deadline: float) -> dict:
    """Every request queued at once (the engine's own refill), stepped until done or the deadline."""
    for request in requests:
        engine.add_request(request)
    replays, steps, produced = [0], 0, 0
    graphs = engine.runner.graphs
    if graphs is not None:
        replay = graphs.replay

        def counted(*args):
            replays[0] += 1
            return replay(*args)
        graphs.replay = counted
    try:
        start = time.monotonic()   # the clock of Run.deadline
        while engine.has_unfinished_requests and time.monotonic() < deadline:
            produced += sum(o.output_tokens for o in engine.step())
            steps += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.monotonic() - start
    finally:
        if graphs is not None:
            del graphs.replay
        unfinished = engine.scheduler.unfinished()
        produced += sum(s.num_output_tokens for s in unfinished)
        engine.abort([s.request_id for s in unfinished])
        engine.reset_prefix_cache()
    return dict(steps=steps, graph_steps=replays[0], output_tokens=produced, seconds=round(seconds, 3),
                output_tok_s=round(produced / seconds, 1), truncated_by_budget=bool(unfinished))


def workload(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(prompt_len)] for _ in range(n)]


def roofline_output_tok_s(weight_bytes: int, kv_bytes_per_token: int, n: int, prompt_len: int, output_len: int,
                          bandwidth: float = HBM_BYTES_S) -> float:
    context = sum(prompt_len + t + 1 for t in range(output_len))   # per sequence, over the T steps
    seconds = (output_len * weight_bytes + n * context * kv_bytes_per_token) / bandwidth
    return n * output_len / seconds


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pipeline_engine(model_dir, device: str, prompts: list[list[int]], output_len: int,
                    quantization: str = "none") -> Engine:
    """The engine run_pipeline times: room for every prompt at once and its output_len tokens."""
    return Engine(EngineConfig(model=str(model_dir), device=device, dtype="bfloat16" if device == "cuda" else "float32",
                               max_model_len=len(prompts[0]) + output_len, max_num_seqs=len(prompts),
                               kv_cache_gib=16 if device == "cuda" else 1, quantization=quantization,
                               batch_invariant=False))


def run_pipeline(model_dir, device: str, prompts: list[list[int]], output_len: int, deadline: float,
                 quantization: str = "none") -> dict:
    """Every prompt queued at once, greedy, exactly output_len tokens each (ignore_eos),
    stepped until done or the deadline; counts the steps replayed from CUDA graphs, and
    times each step: the eager ones' and the replayed ones' wall time, the five slowest
    ([step, ms])."""
    engine = pipeline_engine(model_dir, device, prompts, output_len, quantization)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        list(engine.generate([Request(f"warm{i}", prompt_token_ids=p, params=SamplingParams(temperature=0.0,
                                      max_tokens=4, ignore_eos=True)) for i, p in enumerate(prompts[:2])]))
        engine.reset_prefix_cache()
        replays = [0]
        if engine.runner.graphs is not None:
            replay = engine.runner.graphs.replay

            def counted(*args):
                replays[0] += 1
                return replay(*args)
            engine.runner.graphs.replay = counted
        for i, p in enumerate(prompts):
            if refused := engine.add_request(Request(f"r{i}", prompt_token_ids=p, params=greedy)):   # no assert: -O drops it
                raise RuntimeError(f"request r{i} refused: {refused[0].error}")
        outputs, step_s, replayed = [], [], []
        start = time.perf_counter()
        while engine.has_unfinished_requests and time.perf_counter() < deadline:
            before, t = replays[0], time.perf_counter()
            outputs.extend(engine.step())
            step_s.append(time.perf_counter() - t)
            replayed.append(replays[0] > before)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        steps = len(step_s)
        slowest = sorted(range(steps), key=lambda i: -step_s[i])[:5]
        unfinished = engine.scheduler.unfinished()
        produced = sum(o.output_tokens for o in outputs) + sum(s.num_output_tokens for s in unfinished)
        errors = [o.error for o in outputs if o.error]
        engine.abort([s.request_id for s in unfinished])
        args = engine.model.args
        kv_bytes = args.num_layers * 2 * args.num_kv_heads * args.head_dim * engine.runner.kv_cache.k.element_size()
        return dict(output_tokens=produced, seconds=round(seconds, 3), output_tok_s=round(produced / seconds, 1),
                    steps=steps, graph_steps=replays[0], truncated_by_budget=bool(unfinished),
                    # Wall time of the steps run eagerly (prefill chunks, mixed steps) and of those
                    # replayed; overlapped, a step's wall time includes waiting for the one before.
                    eager_steps_s=round(sum(t for t, r in zip(step_s, replayed) if not r), 3),
                    graph_steps_s=round(sum(t for t, r in zip(step_s, replayed) if r), 3),
                    slowest_steps_ms=[[i, round(step_s[i] * 1e3, 1)] for i in slowest],
                    errors=errors[:3], backend=type(engine.attention_backend).__name__,
                    weight_bytes=parameter_bytes(engine.model), kv_bytes_per_token=kv_bytes,
                    max_num_batched_tokens=engine.scheduler.max_num_batched_tokens)
    finally:
        del engine
        free_memory()


def run_hf_continuous_batching(model_dir, device: str, prompts: list[list[int]], output_len: int) -> dict:
    """transformers' generate_batch (continuous batching) on the same prompts, greedy, EOS off,
    in bf16 on CUDA (float32 on a CPU); a short warm-up call first."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    if not hasattr(model, "generate_batch"):
        raise NotImplementedError("this transformers has no generate_batch (continuous batching)")
    try:
        def config(tokens):
            return GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate_batch(inputs=prompts[:2], generation_config=config(4))
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=config(output_len))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        produced = sum(len(o.generated_tokens) for o in out.values())
        return dict(output_tokens=produced, seconds=round(seconds, 3), output_tok_s=round(produced / seconds, 1),
                    requests=len(out), dtype=str(dtype).removeprefix("torch."))
    finally:
        del model
        free_memory()
