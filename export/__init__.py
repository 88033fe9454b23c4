"""checkpoint -> ONNX, with a parity gate, a device-placement gate and the server's metadata.

`python -m export ckpt.pt model.onnx` (see export/__main__.py for flags and exit statuses);
`export.pipeline.run_export` is the same thing as a function. One module per job:
onnx_export (torch -> ONNX, interface checks), fp16 (graph conversion), parity, runtime
(ONNX Runtime sessions and the provider probe), placement (per-node providers from the
profile), triton (model repository), files (all-or-nothing writes), windows (real windows).
"""

import trainer  # noqa: F401  (before torch: its import guards torch against a stray `triton` folder)
