"""The engine a model directory needs: the decoder Engine, or the EncoderEngine for an
encoder (which only embeds)."""
from __future__ import annotations

from pipeline.config import EngineConfig
from pipeline.models.loader import resolve_model_dir
from pipeline.models.model_dir import is_encoder


def build_engine(config: EngineConfig):
    if is_encoder(resolve_model_dir(config.model)):
        from pipeline.engine.encoder_engine import EncoderEngine
        return EncoderEngine(config)
    from pipeline.engine.engine import Engine
    return Engine(config)
