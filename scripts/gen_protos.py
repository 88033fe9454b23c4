"""Regenerate the gRPC Python stubs in serving/gen from protos/ (the one command for it).

    python scripts/gen_protos.py            # rewrite serving/gen/... in this checkout
    python scripts/gen_protos.py --out DIR  # write DIR/serving/gen/... instead (the stub test does this)

Runs grpc_tools.protoc with --python_out, --grpc_python_out and --pyi_out, with protos/ as the
import root: the descriptors keep the file names a client compiling protos/ gets
(`foxhunt/tft/v1/forecaster.proto`, also what server reflection serves), so their stubs and ours
can share a descriptor pool. protoc's Python modules then import each other as
`foxhunt.tft.v1...`; that prefix is rewritten to `serving.gen.foxhunt.tft.v1...` as the files are
placed under serving/gen, so they need no sys.path tricks.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
PACKAGE = "serving.gen"  # where protos/ appears in the import namespace


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def _in_package(text: str, modules: set[str]) -> str:
    """protoc's references to the modules it generated (`from foxhunt.tft.v1 import forecaster_pb2`, `import
    x_pb2` for a top-level .proto, and their names in strings), moved under PACKAGE; every other import
    (google.protobuf, grpc) is left as it is."""

    def from_import(m: re.Match[str]) -> str:
        pkg, mod, rest = m.groups()
        return f"from {PACKAGE}.{pkg} import {mod}{rest}" if f"{pkg}.{mod}" in modules else m.group(0)

    def plain_import(m: re.Match[str]) -> str:
        mod, alias = m.groups()
        return f"from {PACKAGE} import {mod}{alias or ''}" if mod in modules else m.group(0)

    text = re.sub(r"^from ([\w.]+) import (\w+)(.*)$", from_import, text, flags=re.MULTILINE)
    text = re.sub(r"^import (\w+)( as \w+)?$", plain_import, text, flags=re.MULTILINE)
    return re.sub(r"'([\w.]+)'", lambda m: f"'{PACKAGE}.{m.group(1)}'" if m.group(1) in modules else m.group(0), text)


def generate(out: Path) -> list[Path]:
    """Write the stubs of every .proto under protos/ to out/serving/gen; return the files written."""
    target = out.joinpath(*PACKAGE.split("."))
    well_known = str(resources.files("grpc_tools") / "_proto")
    files = proto_files()
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            *(str(f) for f in files),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        made = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        modules = {".".join(p.relative_to(tmp).with_suffix("").parts) for p in made if p.suffix == ".py"}
        for path in made:
            dest = target / path.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(_in_package(path.read_text(), modules))
    for f in files:  # every directory of the generated package gets an __init__.py
        d = target / f.relative_to(PROTO_ROOT).parent
        while True:
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
            if d == target:
                break
            d = d.parent
    for p in sorted(target.rglob("*")):
        if p.is_file() and p.suffix in (".py", ".pyi"):
            written.append(p)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO, help="root to write serving/gen/... under (default: the repo)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
