"""Nothing is ever downloaded: the Hugging Face libraries are told so before they are used."""
from __future__ import annotations

import os


def offline() -> None:
    """Never reach for a model hub, even by accident through transformers (unless the
    environment says otherwise)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
