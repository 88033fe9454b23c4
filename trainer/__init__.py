"""PyTorch: the TFT model, dataset windows, the training loop, the VRAM planner, checkpoints."""

from __future__ import annotations

import importlib.util
import sys


def hide_a_stray_triton() -> None:
    """A folder named `triton` in the working directory (a Triton model repository, as `python -m export
    --triton-repo triton` writes) is found as a namespace package, and torch takes it for the Triton compiler
    and fails inside its import. When no triton package is installed, torch is told there is none."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return
    if spec is not None and spec.origin is None and spec.submodule_search_locations is not None:
        sys.modules["triton"] = None  # type: ignore[assignment]  # find_spec and import now say: not installed


hide_a_stray_triton()
