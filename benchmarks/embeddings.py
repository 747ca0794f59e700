#!/usr/bin/env python3
"""Texts per second of an embedding corpus: our engine against the usual way, in one run.

    python ../shared/bench/workload.py --model MODEL --out corpus.jsonl --n 2000 --prompt 8:256 --output 1:1
    python benchmarks/embeddings.py --corpus corpus.jsonl --model MODEL [--rounds 3]

For an encoder (all-MiniLM-L6-v2) the peer is sentence-transformers' `encode` with its
default batching (32 texts a batch, sorted by length); for a decoder (the bundled model,
last-token pooling) it is transformers' AutoModel over padded batches of 32 in input order,
pooled the same way. Both in float32 on the CPU (ours in --dtype if given). Rounds alternate (ours, peer, ours,
peer...) so that a noisy machine weighs on both alike; one JSON line per run, then the
median ratio. The vectors of the two are compared too (lowest cosine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from pipeline import EngineConfig, Request, build_engine
from pipeline.models.model_dir import is_encoder
from pipeline.pooling_params import PoolingParams


def ours(engine, texts: list[str]) -> list[list[float]]:
    outs = {o.id: o for o in engine.generate(Request(str(i), prompt=t, pooling=PoolingParams())
                                             for i, t in enumerate(texts))}
    failed = [o for o in outs.values() if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} inputs failed, first: {failed[0].error}")
    return [outs[str(i)].embedding for i in range(len(texts))]


def sentence_transformers_peer(model_dir):
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(str(model_dir), device="cpu")
    return lambda texts: model.encode(texts, convert_to_tensor=True).tolist()


def padded_transformers_peer(model_dir, batch_size: int = 32):
    from transformers import AutoModel, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.padding_side = "right"
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.inference_mode()
    def embed(texts):
        vectors = []
        for at in range(0, len(texts), batch_size):
            batch = tokenizer(texts[at:at + batch_size], padding=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            last = batch["attention_mask"].sum(1) - 1
            vectors += F.normalize(hidden[torch.arange(hidden.shape[0]), last], dim=-1).tolist()
        return vectors
    return embed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True, help="JSONL with a prompt per line (workload.py's)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="our engine's dtype (the peer stays float32): bfloat16 "
                                                        "on a CPU with AVX-512 BF16 or AMX")
    args = ap.parse_args()
    torch.manual_seed(0)
    texts = [json.loads(line)["prompt"] for line in open(args.corpus, encoding="utf-8") if line.strip()]
    engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, device="cpu"))
    # Our engine refuses an input longer than the model takes (sentence-transformers would cut it):
    # both sides get only the texts that fit.
    fits = [t for t in texts if len(engine.tokenize(Request("", prompt=t))) <= engine.max_model_len]
    if len(fits) < len(texts):
        print(json.dumps({"left_out_too_long": len(texts) - len(fits), "max_tokens": engine.max_model_len}))
    texts = fits
    encoder = is_encoder(engine.model_dir)
    peer = sentence_transformers_peer(args.model) if encoder else padded_transformers_peer(args.model)
    name = "sentence-transformers encode" if encoder else "transformers padded batches of 32"
    ours(engine, texts[:8])
    peer(texts[:8])   # warm-ups, not timed
    rates = {"pipeline": [], name: []}
    vectors = {}
    for round_ in range(args.rounds):
        for label, run in (("pipeline", lambda: ours(engine, texts)), (name, lambda: peer(texts))):
            start = time.perf_counter()
            vectors[label] = run()
            seconds = time.perf_counter() - start
            rates[label].append(len(texts) / seconds)
            print(json.dumps({"engine": label, "round": round_, "texts": len(texts), "seconds": round(seconds, 3),
                              "texts_s": round(len(texts) / seconds, 2)}), flush=True)
    lowest = min(F.cosine_similarity(torch.tensor(vectors["pipeline"]), torch.tensor(vectors[name])).tolist())
    ratio = statistics.median(rates["pipeline"]) / statistics.median(rates[name])
    print(json.dumps({"ratio_texts_s": round(ratio, 3), "peer": name, "lowest_cosine": round(lowest, 6),
                      "median_texts_s": {k: round(statistics.median(v), 2) for k, v in rates.items()}}))


if __name__ == "__main__":
    main()
