"""gRPC serving of foxhunt-tft forecasts on ONNX Runtime (`python -m serving --model model.onnx`).

Torch-free by design: the server computes features with the `features` package and runs
the exported ONNX model; `serving.client` is a command-line client.
"""
