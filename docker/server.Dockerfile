# Server image: CUDA runtime + cuDNN, onnxruntime-gpu, gRPC — and no PyTorch.
# Build from the repository root: docker build -f docker/server.Dockerfile -t foxhunt-tft-server .
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
# Ubuntu 22.04's own python3.11 is a release candidate (3.11.0~rc1) that gets no updates; the deadsnakes
# archive carries the 3.11 releases.
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && apt-get purge -y --auto-remove software-properties-common gpg-agent \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY docker/requirements-server.txt ./
# bytecode compiled at build time: each health probe (every 10 s) and the start skip compiling from source
RUN pip install -r requirements-server.txt
COPY pyproject.toml README.md ./
COPY features ./features
COPY serving ./serving
# --no-deps: the package's own dependency list includes torch, which the server never imports.
RUN pip install --no-deps . \
    && python -m compileall -q /app/features /app/serving \
    && useradd --create-home --uid 10001 foxhunt
USER 10001
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-m", "serving.health_probe", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["python", "-m", "serving"]
CMD ["--model", "/models/model.onnx", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9464", "--device", "cuda"]
