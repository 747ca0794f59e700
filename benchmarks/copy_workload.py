#!/usr/bin/env python3
"""A deterministic copy-heavy workload: prompts whose continuation repeats their own text.

    python benchmarks/copy_workload.py --out copy.jsonl [--n 64] [--seed 0] [--words 60:140]

Each prompt is a passage of made-up records and sentences (drawn from fixed word lists
with the seed, so the same arguments always give the same file), then an instruction to
copy it and the passage's first few words: a model continues by copying the rest, as
extraction, rewriting and quoting jobs do. max_tokens is about the passage's length in
tokens (1.3 tokens a word), greedy, ignore_eos so every run generates the same count.
Lines are in the format of ../shared/bench/workload.py, for `pipeline bench`.
"""
from __future__ import annotations

import argparse
import json
import random

NAMES = ["Alice Moreau", "Bruno Keller", "Chen Wei", "Dana Okafor", "Emil Novak", "Farah Haddad",
         "Goran Petrov", "Hana Sato", "Ivan Lopez", "Julia Brandt", "Kofi Mensah", "Lena Fischer"]
CITIES = ["Lyon", "Porto", "Krakow", "Osaka", "Nairobi", "Quito", "Tallinn", "Perth", "Bergen", "Ghent"]
ITEMS = ["steel bolts", "paper rolls", "copper wire", "glass jars", "oak planks", "wool blankets",
         "rubber seals", "ceramic tiles", "cotton thread", "brass hinges"]
VERBS = ["shipped", "ordered", "returned", "inspected", "delivered", "packed", "counted", "stored"]
ADJECTIVES = ["small", "large", "urgent", "late", "partial", "complete", "damaged", "careful"]


def sentence(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return (f"{rng.choice(NAMES)} {rng.choice(VERBS)} {rng.randint(2, 900)} {rng.choice(ITEMS)} "
                f"to {rng.choice(CITIES)} on day {rng.randint(1, 28)}.")
    if kind == 1:
        return (f"Record {rng.randint(1000, 9999)}: {rng.choice(NAMES)}, {rng.choice(CITIES)}, "
                f"{rng.randint(1, 99)} units of {rng.choice(ITEMS)}, status {rng.choice(ADJECTIVES)}.")
    return (f"The {rng.choice(ADJECTIVES)} order from {rng.choice(CITIES)} was {rng.choice(VERBS)} "
            f"by {rng.choice(NAMES)} after a {rng.choice(ADJECTIVES)} check.")


def make(n: int, words: tuple[int, int], seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        target = rng.randint(*words)
        parts: list[str] = []
        while sum(len(p.split()) for p in parts) < target:
            parts.append(sentence(rng))
        passage = " ".join(parts)
        lead = " ".join(passage.split()[:4])
        prompt = f"Text:\n{passage}\n\nThe same text, copied exactly:\n{lead}"
        rows.append({"id": f"copy-{i}", "prompt": prompt,
                     "max_tokens": int(1.3 * len(passage.split())), "temperature": 0.0, "ignore_eos": True})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--words", default="60:140", help="passage length in words, LOW:HIGH")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    low, high = (int(x) for x in a.words.split(":"))
    with open(a.out, "w", encoding="utf-8") as f:
        for row in make(a.n, (low, high), a.seed):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
