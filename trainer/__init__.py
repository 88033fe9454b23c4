"""PyTorch: the TFT model, dataset windows, the training loop, the VRAM planner, checkpoints."""

from __future__ import annotations

import importlib.util
import sys


def hide_a_stray_triton() -> None:
    """A `triton` folder in the working directory (a Triton model repository) would be imported by torch as the
    Triton compiler; when no triton package is installed, torch is told there is none."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return
    if spec is not None and spec.origin is None and spec.submodule_search_locations is not None:
        sys.modules["triton"] = None  # type: ignore[assignment]  # find_spec and import now say: not installed


hide_a_stray_triton()
