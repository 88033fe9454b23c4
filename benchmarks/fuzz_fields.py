"""Every field of Series and PredictRequest mutated, against three real models served: how the server answers, and
what the hostile requests cost it.

    python -m benchmarks.fuzz_fields --out /tmp/fuzz_fields [--examples 2000] [--models tiny,covariates,contracts]
        [--reuse] [--code ../other-checkout] [--verbose] [--json out.json]

1. Builds the three models of the tests with the real commands (`python -m trainer`, `python -m export`) as
   tests.live_server does, each in its folder of `--out` (`--reuse` keeps a model an earlier run left there): bars
   only (tiny); every covariate role, observed, known and static, real and categorical (covariates); per-contract
   futures bars (contracts).
2. For each model starts `python -m serving --threads 1 --max-message-bytes 8388608` on 127.0.0.1 (from `--code`, a
   checkout whose `serving` package runs, e.g. a `git worktree` of an earlier commit; default this one), makes 20
   well-formed calls of warm-up, and sends `--examples` of tests.request_fuzz's mutants, one at a time over a
   raw-bytes channel: its fixed hostile shapes (a list of ~30,000 short strings and one of 3.9 million
   characters; a label of 10^6 characters on 200 bars; contract names and labels with NUL suffixes, full-width or
   Arabic-Indic digits, bidi overrides), then every field's mutations alone, then mixes. Hypothesis draws them
   with derandomize=True, no database and no shrinking: the same requests on every run of one checkout of tests/.
3. Prints a markdown table row per model: answers by status code, the server's RSS after warm-up, its peak (the
   high-water mark from the end of warm-up, and the RSS after every call) and their ratio, the slowest call; then
   for each model whatever falls short of the target, with the INTERNAL and UNKNOWN answers and the mutations
   behind them, and the calls that raised the peak most (`--verbose`: the answers per mutation and by message).

Exit status 0 when every model meets the target: 0 INTERNAL, 0 UNKNOWN, health SERVING after the run, 20
well-formed calls after it all OK, no ERROR line and no traceback in the server's log, and peak RSS <= 1.5x the
RSS after warm-up; else 1. Loopback only; one CPU core does for the server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import onnxruntime as ort

from tests.live_server import REPO, LiveServer, build_contracts_model, build_covariates_model, build_tiny_model
from tests.request_fuzz import MAX_MESSAGE, Report, Target, contracts_target, covariates_target, fuzz, tiny_target

MODELS: dict[str, tuple[Callable[[Path, bool], Any], Callable[[Any], Target]]] = {
    "tiny": (build_tiny_model, tiny_target),
    "covariates": (build_covariates_model, covariates_target),
    "contracts": (build_contracts_model, contracts_target),
}
NAMED = ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNKNOWN", "INTERNAL")


def table(reports: list[Report]) -> str:
    head = ("| model | requests | OK | INVALID_ARGUMENT | RESOURCE_EXHAUSTED | UNKNOWN | INTERNAL | other | RSS after "
            "warm-up | peak RSS | peak / warm-up | slowest call |\n" + "|---" * 12 + "|")
    rows = []
    for r in reports:
        other = sum(v for k, v in r.codes.items() if k not in NAMED)
        others = ", ".join(f"{k} {v}" for k, v in r.codes.items() if k not in NAMED)
        slowest = f"{1000 * r.slowest.seconds:.0f} ms ({'+'.join(r.slowest.ops)})" if r.slowest else "-"
        rows.append(f"| {r.model} | {r.sent:,} | " + " | ".join(f"{r.codes[k]:,}" for k in NAMED)
                    + f" | {other}{f' ({others})' if others else ''} | {r.rss_warm_kib / 1024:.0f} MiB | "
                      f"{r.rss_peak_kib / 1024:.0f} MiB | {r.ratio:.2f}x | {slowest} |")
    return "\n".join([head, *rows])


def shortfalls(r: Report) -> list[str]:
    """What of the target a model's run missed, the INTERNAL and UNKNOWN answers, and what raised the peak."""
    lines = [f"{r.model}: " + ("; ".join(r.failures()) or "meets the target")
             + f" (RSS at the end {r.rss_end_kib / 1024:.0f} MiB)"]
    lines += r.never_lines()
    lines += [f"  peak +{kib / 1024:.1f} MiB after {'+'.join(ops)}" for kib, ops in sorted(r.growth, reverse=True)[:5]]
    lines += [f"  log: {line[:200]}" for line in r.log_problems[:5]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the models and the servers' logs")
    p.add_argument("--examples", type=int, default=2000, help="mutated requests per model (default 2000)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} (default all)")
    p.add_argument("--reuse", action="store_true", help="keep the models an earlier run built in --out")
    p.add_argument("--code", type=Path, default=REPO, help="the checkout whose `serving` runs (default this one)")
    p.add_argument("--verbose", action="store_true", help="also the answers per mutation and by message")
    p.add_argument("--json", type=Path, help="also write the reports as JSON here")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in names if m not in MODELS]:
        p.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if args.examples < 1:
        p.error("--examples must be >= 1")
    if not (args.code / "serving" / "__main__.py").is_file():
        p.error(f"--code {args.code}: no serving package there")

    reports = []
    for name in names:
        build, make = MODELS[name]
        work = args.out / name
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        target = make(build(work, args.reuse))
        print(f"{name}: model {target.meta.model_version} ready in {time.monotonic() - started:.0f} s", flush=True)
        server = LiveServer(target.model, work / "server.log", "--max-message-bytes", str(MAX_MESSAGE),
                            code=args.code)
        try:
            server.wait_serving()
            started = time.monotonic()
            report = fuzz(server, target, args.examples)
        finally:
            server.kill()
        print(f"{name}: {report.sent} requests in {time.monotonic() - started:.0f} s", flush=True)
        if args.verbose:
            print(report.describe(), flush=True)
        reports.append(report)

    print()
    print(table(reports))
    print()
    for r in reports:
        print("\n".join(shortfalls(r)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}, onnxruntime {ort.__version__}, grpcio {grpc.__version__}; server from "
          f"{args.code.resolve()}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"ratio": r.ratio} for r in reports], indent=2, default=str))
    return 0 if all(not r.failures() for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
