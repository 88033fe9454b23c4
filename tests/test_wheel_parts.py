"""scripts/wheel_parts.sh: wheels cut into parts that each fit one transfer, joined and checked on arrival."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "wheel_parts.sh"
MIB = 1 << 20


def parts(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    """Three files named as wheels, 2.5 MiB in all, of bytes that do not repeat (a cut in the wrong place shows)."""
    d = tmp_path / "wheels"
    d.mkdir()
    for name, size in (("onnxruntime_gpu-1.0-cp312-cp312-linux_x86_64.whl", 2 * MIB),
                       ("grpcio_reflection-1.0-py3-none-any.whl", MIB // 2), ("tiny-1.0-py3-none-any.whl", 7)):
        (d / name).write_bytes(os.urandom(size))
    return d


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.whl"))}


def test_split_then_join_gives_back_every_wheel_with_parts_under_the_limit(wheels: Path, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    done = parts("split", wheels, stage, "--max-mib", "1")
    assert done.returncode == 0, done.stderr
    folders = sorted(stage.iterdir())
    assert [f.name for f in folders] == ["p1", "p2", "p3"]  # 2.5 MiB and a tar's headers in parts of <= 1 MiB
    for f in folders:
        assert sorted(p.name for p in f.iterdir()) == ["parts", "wheels.tar.part", "wheels.tar.sha256"]
        assert (f / "wheels.tar.part").stat().st_size <= MIB
        assert (f / "parts").read_text().strip() == "3"
    joined = parts("join", stage, tmp_path / "out")
    assert joined.returncode == 0, joined.stderr
    assert digests(tmp_path / "out") == digests(wheels)


def test_join_names_a_missing_part_and_unpacks_nothing(wheels: Path, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    assert parts("split", wheels, stage, "--max-mib", "1").returncode == 0
    (stage / "p2" / "wheels.tar.part").unlink()
    joined = parts("join", stage, tmp_path / "out")
    assert joined.returncode == 2
    assert "lacks part(s) p2 of 3" in joined.stderr
    assert not (tmp_path / "out").exists()


def test_join_refuses_an_altered_part_by_its_checksum(wheels: Path, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    assert parts("split", wheels, stage, "--max-mib", "1").returncode == 0
    part = stage / "p3" / "wheels.tar.part"
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    part.write_bytes(bytes(data))
    joined = parts("join", stage, tmp_path / "out")
    assert joined.returncode == 2
    assert "sha256" in joined.stderr and "carry the parts again" in joined.stderr
    assert not (tmp_path / "out").exists()


def test_join_refuses_a_part_of_another_split(wheels: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    assert parts("split", wheels, first, "--max-mib", "1").returncode == 0
    (wheels / "tiny-1.0-py3-none-any.whl").write_bytes(b"changed")
    assert parts("split", wheels, second, "--max-mib", "1").returncode == 0
    (first / "p2").rename(first / "p2.old")
    (second / "p2").rename(first / "p2")
    joined = parts("join", first, tmp_path / "out")
    assert joined.returncode == 2
    assert "belongs to another split" in joined.stderr


def test_split_refuses_a_folder_without_wheels_and_a_stage_in_use(wheels: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = parts("split", empty, tmp_path / "stage")
    assert refused.returncode == 2 and "no wheels" in refused.stderr
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep").write_text("x")
    refused = parts("split", wheels, used)
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert (used / "keep").read_text() == "x"


def test_split_refuses_two_versions_of_one_wheel(wheels: Path, tmp_path: Path) -> None:
    (wheels / "onnxruntime_gpu-0.9-cp312-cp312-linux_x86_64.whl").write_bytes(b"older")
    refused = parts("split", wheels, tmp_path / "stage")
    assert refused.returncode == 2 and "more than one wheel of: onnxruntime_gpu" in refused.stderr
    assert not (tmp_path / "stage").exists()


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: (p / "parts").write_text("BASH_VERSINFO[$(touch PWNED)0]\n"), "not a part count"),
    (lambda p: (p / "wheels.tar.sha256").unlink(), "lacks its wheels.tar.sha256"),
])
def test_join_names_a_part_cut_short_and_runs_nothing_it_holds(damage: Callable[[Path], object], message: str,
                                                              wheels: Path, tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    assert parts("split", wheels, stage, "--max-mib", "1").returncode == 0
    for p in sorted(stage.iterdir()):
        damage(p)
    joined = subprocess.run(["bash", str(SCRIPT), "join", str(stage), str(tmp_path / "out")], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert joined.returncode == 2 and message in joined.stderr, joined.stderr
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()
