"""Where a model's files are, checked without loading them (no torch, no transformers).

A model is the bundled one (None, or its name) or a local Hugging Face directory with a
config.json and safetensors weights. `pipeline submit` and `pipeline serve` check it
before a job is queued, so a job for a path that is no model is refused at once instead
of failing on every worker. Nothing is ever downloaded: `offline()` (offline.py) tells the Hugging
Face libraries so before they are used.
"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.models.bundled import BUNDLED_NAME

# BERT-family sentence encoders (all-MiniLM, BGE, E5, GTE...): they embed and cannot generate.
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "RobertaModel", "XLMRobertaModel")


def is_encoder(model_dir: Path) -> bool:
    """Whether the model directory holds an encoder (embeddings only), by its config's architecture;
    False when it has no readable config here (a directory only the workers have)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("architectures") or ["?"])[0] in ENCODER_ARCHITECTURES


def context_length(model_dir: Path, max_model_len: int | None = None) -> int:
    """The most tokens a request may hold on this model (EngineConfig.max_model_len caps it): a
    decoder's positions; an encoder's sentence-transformers max_seq_length, the input length its
    authors chose, within its positions."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    positions = config.get("max_position_embeddings", 512 if is_encoder(model_dir) else 2048)
    chosen = positions
    st_config = model_dir / "sentence_bert_config.json"
    if is_encoder(model_dir) and st_config.is_file():
        chosen = json.loads(st_config.read_text()).get("max_seq_length") or positions
    return min(max_model_len or chosen, chosen, positions)


def readable_model_dir(model: str | None) -> Path | None:
    """The directory of `model` (None or its name: the bundled one) when its config.json can be
    read here, else None (a directory only the workers have; the bundled package absent)."""
    try:
        if is_bundled(model):
            from pipeline.models.bundled import bundled_model_dir
            path = bundled_model_dir()
        else:
            path = Path(model).expanduser()
        return path if (path / "config.json").is_file() else None
    except (OSError, RuntimeError):   # RuntimeError: the bundled model's package is not installed
        return None


def vocabulary_size(model: str | None) -> int | None:
    """The model's vocabulary (config.json's vocab_size: the rows of its embedding table), or
    None when it cannot be read here."""
    path = readable_model_dir(model)
    try:
        size = json.loads((path / "config.json").read_text()).get("vocab_size") if path else None
    except (OSError, ValueError):
        return None
    return size if type(size) is int and size > 0 else None


def is_bundled(model: str | None) -> bool:
    return model is None or model == BUNDLED_NAME


def check_model_dir(model: str, *, weights: bool = True) -> Path:
    """The local model directory `model` names; ValueError saying what is missing if it is
    not one (no such directory, no config.json, an unreadable config, with weights=True no
    safetensors weights: the loader says that itself, after the architecture)."""
    path = Path(model).expanduser()
    hint = ("Nothing is downloaded from a model hub: give the path of a local checkpoint, "
            f"or leave the model out to use the bundled {BUNDLED_NAME}.")
    if not path.is_dir():
        raise ValueError(f"model {model!r} is not a local Hugging Face model directory (no such directory). {hint}")
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"model {model!r} is not a local Hugging Face model directory (no config.json there). {hint}")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model {model!r}: its config.json cannot be read as JSON ({e})") from None
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"model {model!r} has no *.safetensors weights")
    return path
