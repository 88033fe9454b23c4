"""PyTorch: the TFT model, dataset windows, the training loop, the VRAM planner, checkpoints.

Importing this package (as `python -m trainer` and `python -m export` do, before torch) guards torch
against a stray `triton` folder: see `hide_a_stray_triton`.
"""

from __future__ import annotations

import importlib.util
import sys


def hide_a_stray_triton() -> None:
    """`python -m` puts the working directory first on sys.path, so a folder named `triton` there (a Triton
    model repository, as `python -m export --triton-repo triton` writes one) is found as a namespace
    package, torch takes it for the Triton compiler, and fails deep inside its own import (`module 'triton'
    has no attribute 'language'`). Where that folder is all there is (no triton package is installed:
    a package proper would be found before any folder), torch is told that there is no triton."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return
    if spec is not None and spec.origin is None and spec.submodule_search_locations is not None:
        sys.modules["triton"] = None  # type: ignore[assignment]  # find_spec and import now say: not installed


hide_a_stray_triton()
