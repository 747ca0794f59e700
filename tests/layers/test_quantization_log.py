"""bitsandbytes' int8 matmul logs that it casts its input to float16 on every call (every
layer, every step): quantize() lets that line through once a process."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from pipeline.layers.quantization.modes import BNB_CAST_LOGGER, CastWarningOnce, quantize

pytest.importorskip("bitsandbytes")


def test_the_cast_warning_is_logged_once_across_calls_and_models(caplog, monkeypatch):
    logger = logging.getLogger(BNB_CAST_LOGGER)
    monkeypatch.setattr(logger, "filters", [])   # as in a fresh process
    caplog.set_level(logging.WARNING, BNB_CAST_LOGGER)
    x = torch.randn(3, 64)
    for _ in range(2):   # two engines' worth of quantized layers
        model = nn.Module()
        model.qkv_proj = nn.Linear(64, 64)
        quantize(model, "int8", torch.device("cpu"), torch.float32)
        for _ in range(3):
            model.qkv_proj(x)
    casts = [r for r in caplog.records if r.getMessage().startswith(CastWarningOnce.PREFIX)]
    assert len(casts) == 1
    assert sum(isinstance(f, CastWarningOnce) for f in logger.filters) == 1
    other = logging.LogRecord(BNB_CAST_LOGGER, logging.WARNING, __file__, 1, "something else", (), None)
    assert all(f.filter(other) for f in logger.filters)   # the rest goes through
