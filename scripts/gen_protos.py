"""Regenerate the gRPC Python stubs in serving/gen from protos/ (the one command for it).

    python scripts/gen_protos.py            # rewrite serving/gen/... in this checkout
    python scripts/gen_protos.py --out DIR  # write DIR/serving/gen/... instead (the stub test does this)

Runs grpc_tools.protoc with --python_out, --grpc_python_out and --pyi_out. protos/ is
mounted at the import path `serving/gen`, so the generated modules import each other as
`serving.gen.foxhunt.tft.v1...` and need no sys.path tricks; the .proto keeps the
conventional package layout (foxhunt/tft/v1/) under protos/.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO / "protos"
MOUNT = "serving/gen"  # where protos/ appears in the import namespace


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Write the stubs of every .proto under protos/ to out/serving/gen; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    files = proto_files()
    args = [
        "grpc_tools.protoc",
        f"-I{MOUNT}={PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(str(f) for f in files),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    written = []
    for f in files:  # every directory of the generated package gets an __init__.py
        rel = f.relative_to(PROTO_ROOT).parent
        d = out / MOUNT / rel
        while True:
            init = d / "__init__.py"
            if not init.exists():
                init.write_text("")
            if d == out / MOUNT:
                break
            d = d.parent
    for p in sorted((out / MOUNT).rglob("*")):
        if p.is_file() and p.suffix in (".py", ".pyi"):
            written.append(p)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO, help="root to write serving/gen/... under (default: the repo)")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
