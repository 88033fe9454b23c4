# Trainer image: CUDA PyTorch, the whole package. Runs `python -m trainer` and `python -m export`.
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t foxhunt-tft-trainer .
FROM nvidia/cuda:13.0.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY features ./features
COPY trainer ./trainer
COPY export ./export
COPY serving ./serving
# torch==2.13.0 resolves to the CUDA build on Linux x86_64; pins come from pyproject.toml.
RUN pip install --no-compile . \
    && useradd --create-home --uid 10001 foxhunt
USER 10001
ENTRYPOINT ["python", "-m", "trainer"]
CMD ["--help"]
