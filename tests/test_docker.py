"""The container files: linted with hadolint, and consistent with the repository they build.

The suite does not build or run the images (no Docker engine on CI); these checks catch what
would break a build: a linted Dockerfile, COPY sources that exist, pins that match pyproject.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def _pins() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[=<>]", d)[0].lower(): d for d in deps}


def test_there_is_a_trainer_and_a_server_image() -> None:
    assert {p.name for p in DOCKERFILES} == {"trainer.Dockerfile", "server.Dockerfile"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    r = subprocess.run([hadolint, "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist_and_base_is_cuda(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+cudnn-runtime", text, re.M)
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (REPO / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"


def test_server_image_pins_match_pyproject_and_leave_out_torch() -> None:
    pins = _pins()
    reqs = [line.strip() for line in (REPO / "docker" / "requirements-server.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert reqs, "empty requirements"
    for req in reqs:
        name = re.split(r"[=<>]", req)[0].lower()
        assert pins.get(name) == req, f"{req} differs from pyproject's {pins.get(name)}"
    assert not any(r.lower().startswith(("torch", "onnx==", "matplotlib")) for r in reqs)
    # every dependency the server imports is in the image: the rest are training's, export's or benchmarks'
    not_for_server = {"torch", "onnx", "onnxscript", "grpcio-tools", "tqdm", "matplotlib", "psutil",
                      "databento-dbn", "pandas-market-calendars"}  # a bars file's readers: DBN, expirations
    listed = {re.split(r"[=<>]", r)[0].lower() for r in reqs}
    assert set(pins) - not_for_server == listed, f"server image lacks {set(pins) - not_for_server - listed}"
    server = (REPO / "docker" / "server.Dockerfile").read_text()
    assert "--no-deps ." in server and "COPY trainer" not in server


def test_compose_runs_train_export_serve_in_order_each_reachable_by_stop() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert list(services) == ["train", "export", "serve"]
    for svc in services.values():
        assert (REPO / svc["build"]["dockerfile"]).exists()
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        # exec form, no shell in between: `docker compose stop`'s SIGTERM reaches python (PID 1) itself
        assert isinstance(svc.get("command", []), list) and svc.get("entrypoint", ["python"])[0] == "python"
    assert services["export"]["depends_on"] == {"train": {"condition": "service_completed_successfully"}}
    assert services["serve"]["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
    train, export = services["train"]["command"], services["export"]["command"]
    assert train[train.index("--vram-budget") + 1] == "4GiB" and train[train.index("--device") + 1] == "cuda"
    assert export[:2] == [train[train.index("--out") + 1], "/models/model.onnx"] and "--require-device" in export
    assert "serving.health_probe" in services["serve"]["healthcheck"]["test"]
    grace = float(re.sub(r"s$", "", services["serve"]["stop_grace_period"]))
    assert grace > 10  # the server's default --grace: a drain finishes before docker's SIGKILL
    # a new named volume takes its mount point's owner: /models must be the image user's for training to write
    trainer = (REPO / "docker" / "trainer.Dockerfile").read_text()
    assert "install -d -o 10001 -g 10001 /models" in trainer and "USER 10001" in trainer
