"""What an export is asked to do. Free of torch and onnx, so flags are checked before those imports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.data import ReadBars

MIN_OPSET = 18  # the torch.export-based exporter's oldest
DEFAULT_OPSET = 18
MAX_OPSET = 23  # the newest opset onnxruntime 1.31 runs


@dataclass(frozen=True)
class ExportOptions:
    checkpoint: Path
    output: Path
    opset: int = DEFAULT_OPSET
    fp16: bool = False
    explain: bool = True
    require_device: str | None = None  # "cuda" | "cpu" | None (gate not run)
    triton_repo: Path | None = None
    triton_name: str = ""  # default: the output file's stem
    triton_max_batch_size: int = 256
    bars: Path | None = None  # rebuild parity windows from these bars instead of the saved sample
    column_flags: dict[str, str] = dataclasses.field(default_factory=dict)  # --bars' names given, over the run's
    threads: int = 1
    calibrate: bool = False  # fold conformal offsets fitted on the run's validation split into the graph
    calibrate_median: bool = False  # with calibrate: the median's offset too (else the median stays the model's)
    run_bars: ReadBars | None = None  # the run's bars in memory (a backtest fold's): --calibrate reads these

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16 else "fp32"

    @property
    def model_name(self) -> str:
        return self.triton_name or self.output.stem
