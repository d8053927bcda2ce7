"""Pallas kernels for TPU (Mosaic): LoRA shrink/expand and paged attention over the unified pool."""

import os

INTERPRET_ENV = "SLORA_TPU_INTERPRET"


def interpret_mode() -> bool:
    """Whether the kernels run in TPU interpret mode (pltpu.InterpretParams) instead of through
    Mosaic: SLORA_TPU_INTERPRET=1, which lets the CPU tests run them through the engine."""
    return os.environ.get(INTERPRET_ENV, "") == "1"
