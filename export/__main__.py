"""`python -m export ckpt.pt model.onnx`: a checkpoint to an ONNX model that has been proved.

The model takes raw features and returns quantiles of cumulative log return [batch, horizon,
n_quantiles], plus attention and variable-selection weights unless --no-explain. Its metadata
carries what the server needs, including the parity and placement reports.

Checks, in order, before anything is written: onnx.checker (full); names, dtypes and the dynamic
batch axis; parity against PyTorch on real windows and random batches of 1, 7 and 64; device
placement (a gate only with --require-device, else reported as not run). The outputs appear
only when every check passed. With --calibrate, conformal offsets fitted on the run's validation
split are folded into the graph first, and the checks prove the calibrated model.

exit status:
  0  the model (and the Triton repository entry) was written
  1  a check failed, torch could not export the model, or a file could not be written
  2  bad arguments or unusable input (checkpoint, paths, --bars, --require-device cuda without
     a CUDA provider)
  130  interrupted
On 1, 2 and 130 nothing was written.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from export.errors import CheckFailed, ExportError, UsageError
from export.options import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET, ExportOptions
from export.triton import NAME_RE
from features.bars import ColumnMap, clash_with_bars
from features.file_kind import replace_problem
from features.files import file_argument

if TYPE_CHECKING:
    from export.pipeline import Tamper


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="checkpoint written by `python -m trainer` (loaded weights-only)")
    p.add_argument("output", type=file_argument("model.onnx"),
                   help="the ONNX model to write, e.g. model.onnx (missing directories are made as it is written)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                   help=f"ONNX opset, {MIN_OPSET}..{MAX_OPSET} (default {DEFAULT_OPSET})")
    p.add_argument("--fp16", action="store_true",
                   help="half-precision weights and compute, float32 inputs and outputs (parity tolerance 1e-2)")
    p.add_argument("--no-explain", dest="explain", action="store_false",
                   help="only the quantiles output: no attention or variable-selection weights")
    p.add_argument("--require-device", choices=["cuda", "cpu"],
                   help="placement gate: every compute node must run on this device's ONNX Runtime provider "
                        "(cuda is refused at once, exit 2, where the CUDA provider does not load, saying why)")
    p.add_argument("--triton-repo", type=Path, metavar="DIR",
                   help="also write DIR/<name>/config.pbtxt and DIR/<name>/1/model.onnx for Triton Inference Server")
    p.add_argument("--triton-name", default="", help="Triton model name (default: the output file's stem)")
    p.add_argument("--triton-max-batch-size", type=int, default=256,
                   help="max_batch_size in config.pbtxt (default 256)")
    p.add_argument("--bars", type=Path,
                   help="rebuild the parity check's real windows from these bars (parquet file or directory) "
                        "instead of the checkpoint's saved validation sample; with --calibrate, the run's bars to "
                        "rebuild its validation split from")
    p.add_argument("--calibrate", action="store_true",
                   help="fit conformal offsets (one per horizon step and quantile) on the run's validation split, "
                        "rebuilt from its bars (--bars, else the checkpoint's data source), and fold them into "
                        "the model; the metadata and GetModelInfo report the coverage before and after. The "
                        "median keeps the model's forecast unless --calibrate-median")
    p.add_argument("--calibrate-median", action="store_true",
                   help="with --calibrate: shift the median (0.5 quantile) too; a validation split's drift rarely "
                        "carries into the next period, so by default only the other quantiles move")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for PyTorch and ONNX Runtime during the checks (default 1)")
    ColumnMap.add_arguments(p, "with --bars only; a name not given is the training run's")
    return p


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    """Check what can be checked before loading anything; UsageError names the flag and the fix."""
    out: Path = args.output
    if not MIN_OPSET <= args.opset <= MAX_OPSET:
        raise UsageError(f"--opset {args.opset}: supported opsets are {MIN_OPSET}..{MAX_OPSET} "
                         f"(the torch.export-based exporter starts at {MIN_OPSET}; onnxruntime runs up to {MAX_OPSET})")
    if args.threads < 1:
        raise UsageError(f"--threads {args.threads}: must be >= 1")
    _check_output(out, args.checkpoint)
    if args.triton_repo is not None:
        _check_triton(args, out)
    elif args.triton_name or args.triton_max_batch_size != 256:
        raise UsageError("--triton-name and --triton-max-batch-size only apply with --triton-repo DIR")
    if args.bars is not None and not args.bars.exists():
        raise UsageError(f"--bars {args.bars}: no such file or directory")
    if args.bars is not None and (problem := clash_with_bars(out, args.bars)):
        raise UsageError(f"{problem}; choose another output file")
    if problem := replace_problem(out, "an ONNX model"):
        raise UsageError(problem)
    if args.calibrate_median and not args.calibrate:
        raise UsageError("--calibrate-median shifts the median of a calibration: add --calibrate")
    if args.bars is None and (given := ColumnMap.given(args)):
        flags = ", ".join(ColumnMap.flag(f) for f in given)
        raise UsageError(f"{flags}: column mapping applies to --bars only (the checkpoint's own windows need none)")
    if not args.checkpoint.exists():  # said before torch's import
        raise UsageError(f"{args.checkpoint}: no such checkpoint file")
    return ExportOptions(checkpoint=args.checkpoint, output=out, opset=args.opset, fp16=args.fp16,
                         explain=args.explain, require_device=args.require_device, triton_repo=args.triton_repo,
                         triton_name=args.triton_name, triton_max_batch_size=args.triton_max_batch_size,
                         bars=args.bars, column_flags=ColumnMap.given(args), threads=args.threads,
                         calibrate=args.calibrate, calibrate_median=args.calibrate_median)


def _check_output(out: Path, checkpoint: Path) -> None:
    if out.is_dir():
        raise UsageError(f"{out} is a directory; give the model's file name, e.g. {out / 'model.onnx'}")
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"{out}: {out.parent} is a file, not a directory; give a path in a directory")
    if checkpoint.is_dir():
        inside = next((checkpoint / n for n in ("ckpt.pt", "ckpt.last.pt") if (checkpoint / n).is_file()), None)
        raise UsageError(f"{checkpoint} is a directory; give the checkpoint file in it"
                         + (f", e.g. {inside}" if inside else " (the trainer's --out, ckpt.pt by default)"))
    if checkpoint.exists() and out.resolve() == checkpoint.resolve():
        raise UsageError(f"{out} is the checkpoint itself; choose another output file")


def _check_triton(args: argparse.Namespace, out: Path) -> None:
    if args.triton_repo.exists() and not args.triton_repo.is_dir():
        raise UsageError(f"--triton-repo {args.triton_repo} is a file, not a directory")
    if not NAME_RE.match(name := args.triton_name or out.stem):
        raise UsageError(f"Triton model name {name!r} must be letters, digits, '_', '.' or '-' and not start with "
                         "'.' or '-'; pass --triton-name NAME")
    if args.triton_max_batch_size < 1:
        raise UsageError(f"--triton-max-batch-size {args.triton_max_batch_size}: must be >= 1")
    entry: Path = args.triton_repo / name
    if entry.exists() and not entry.is_dir():
        raise UsageError(f"--triton-repo: {entry} exists and is not a directory; the Triton model directory "
                         "would replace it: remove it, or pass --triton-name NAME")
    if out.resolve().is_relative_to(entry.resolve()):
        raise UsageError(f"{out} is inside the Triton model directory {entry.resolve()}, which export replaces as a "
                         "whole; write the model file elsewhere")


def main(argv: list[str] | None = None, *, _tamper: Tamper | None = None) -> int:
    """Run the export; returns the exit status. `_tamper`: a test hook (see pipeline.run_export)."""
    args = build_parser().parse_args(argv)
    published: list[Path] = []
    try:
        opts = options_from_args(args)
        from export.pipeline import run_export  # torch and onnx (seconds) once the flags hold

        run_export(opts, published=published, _tamper=_tamper)
    except OSError as exc:  # what Staging does not cover: a temporary file of the checks, or stderr closed
        if published:  # the export is complete; its report failed (a closed pipe, most likely)
            with contextlib.suppress(OSError):
                print(f"warning: {exc}, after {', '.join(map(str, published))} had been written whole",
                      file=sys.stderr, flush=True)
            return 0
        print(f"error: {exc}\nnothing was written.", file=sys.stderr, flush=True)
        return 1
    except ExportError as exc:
        verdict = "export refused" if isinstance(exc, CheckFailed) else "error"
        print(f"{verdict}: {exc}\nnothing was written.", file=sys.stderr, flush=True)
        return exc.exit_status
    except KeyboardInterrupt:
        if published:  # the files are in place, whole: the export is done
            whole = "were published: they are" if len(published) > 1 else "was published: it is"
            print(f"interrupted after {', '.join(map(str, published))} {whole} complete", file=sys.stderr)
            return 0
        print("interrupted; nothing was written.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM as Ctrl-C: exit 130, nothing written
    sys.exit(main())
