"""Batch LLM inference engine: continuous batching over a paged KV cache.

The engine is usable on its own and knows nothing of Celery, SQL or Parquet:

    from pipeline import Engine, EngineConfig, Request, SamplingParams
    engine = Engine(EngineConfig())                      # bundled SmolLM2-135M-Instruct
    for out in engine.generate([Request("q1", prompt="Hello")]):
        print(out.id, out.text)
"""
from pipeline.config import EngineConfig
from pipeline.request import FinishReason, Request, RequestOutput
from pipeline.sampling_params import SamplingParams


def __getattr__(name):
    # Engine pulls in torch; import it lazily so `jobs` and the CLI start fast.
    if name == "Engine":
        from pipeline.engine.engine import Engine
        return Engine
    if name == "build_engine":
        from pipeline.engine.factory import build_engine
        return build_engine
    raise AttributeError(name)


__all__ = ["Engine", "build_engine", "EngineConfig", "FinishReason", "Request", "RequestOutput", "SamplingParams"]
