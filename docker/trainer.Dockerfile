# Trainer image: CUDA PyTorch, the whole package. Runs `python -m trainer` and `python -m export`.
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t foxhunt-tft-trainer .
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
COPY pyproject.toml README.md ./
# The dependencies first, in a layer a code change does not rebuild; the pins are pyproject.toml's
# (torch==2.13.0 resolves to the CUDA build on Linux x86_64).
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-compile -r /tmp/requirements.txt
COPY features ./features
COPY trainer ./trainer
COPY export ./export
COPY serving ./serving
# /models belongs to the user the image runs as, so a volume mounted there (a new named volume
# takes the mount point's owner) is writable by it.
RUN pip install --no-compile --no-deps . \
    && useradd --create-home --uid 10001 foxhunt \
    && install -d -o 10001 -g 10001 /models
USER 10001
ENTRYPOINT ["python", "-m", "trainer"]
CMD ["--help"]
