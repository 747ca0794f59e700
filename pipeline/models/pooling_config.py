"""How a model's hidden states become one embedding vector, read from its directory.

Sentence-transformers directories say it in `modules.json` (a Pooling module with its
`config.json`, e.g. `1_Pooling/config.json`, and a Normalize module when vectors are made
unit length). A directory without them gets the documented default: a decoder pools its
last token (what Qwen3-Embedding and other decoder embedders do: a causal model's last
position is the only one that has seen the whole input), an encoder the mean of its
tokens; both normalised, as OpenAI's embeddings are. No torch here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys -> our method.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(slots=True, frozen=True)
class PoolingConfig:
    method: str        # one of POOLING_METHODS
    normalize: bool    # vectors are made unit length (L2)

    def __post_init__(self):
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling {self.method!r}: expected one of {', '.join(POOLING_METHODS)}")


def read_pooling_config(model_dir: Path, *, decoder: bool) -> PoolingConfig:
    """The model's pooling: from its sentence-transformers files, else the default for its kind.
    ValueError for a pooling mode we do not have (max, mean of sqrt length, weighted...)."""
    default = PoolingConfig("last" if decoder else "mean", True)
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return default
    modules = json.loads(modules_file.read_text())
    types = {m.get("type"): m for m in modules}
    pooling = types.get(_POOLING)
    if pooling is None:
        return PoolingConfig(default.method, _NORMALIZE in types)
    config = json.loads((Path(model_dir) / pooling.get("path", "") / "config.json").read_text())
    chosen = [method for key, method in _MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _MODES)
    if others or len(chosen) != 1:
        raise ValueError(f"{model_dir}: pooling {', '.join(others + chosen) or 'none'} is not supported "
                         f"(one of {', '.join(_MODES)})")
    return PoolingConfig(chosen[0], _NORMALIZE in types)
