"""The house in figures: source lines, long functions, test lines and doc words.

    python scripts/house_figures.py [CHECKOUT]
"""

import ast
import re
import sys
from pathlib import Path

SOURCE = ("features", "trainer", "export", "serving", "backtest")  # serving/gen (generated stubs) is left out


def words(path: Path) -> int:
    return len(re.findall(r"\S+", path.read_text()))


def main(root: Path) -> None:
    files = [p for d in SOURCE for p in (root / d).rglob("*.py") if "gen" not in p.parts]
    lines = sum(len(p.read_text().splitlines()) for p in files)
    lengths = [n.end_lineno - n.lineno + 1 for p in files for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno is not None]
    tests = sum(len(p.read_text().splitlines()) for p in (root / "tests").glob("*.py"))
    print(f"source {lines} lines; functions over 60 lines: {sum(n > 60 for n in lengths)}, over 40: "
          f"{sum(n > 40 for n in lengths)}, longest {max(lengths)}; tests {tests} lines; "
          f"README {words(root / 'README.md')} words; BENCHMARKS {words(root / 'BENCHMARKS.md')} words")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
