"""checkpoint -> ONNX with parity and placement gates: `python -m export`, or `export.pipeline.run_export`."""

import trainer  # noqa: F401  (before torch: its import guards torch against a stray `triton` folder)
