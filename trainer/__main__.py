"""`python -m trainer --parquet bars.parquet`: train a TFT and write a resumable checkpoint.

Exit status: 0 done, 1 an output could not be written, 2 bad arguments, config or data, a VRAM
budget that cannot hold the run, or a diverged loss, 3 out of memory with nothing left to halve,
130 interrupted. In every case the last good checkpoint is intact.

`--vram-budget 4GiB` fits micro-batch, accumulation and gradient checkpointing to the budget and
caps the process's CUDA memory to it; `--plan-only` prints that plan and exits, on any machine.

Per-contract futures bars (ESH5, ESM5, ... or names mapped by `--roots`) train one continuous series per
root (ES): a roll rule (`--roll`, default volume) picks each session's front contract, returns are taken within
a contract, and the rolls are logged and stored in the checkpoint.

`--tracking tensorboard:DIR` or `--tracking mlflow:URI` also logs the config, each epoch's figures, the report
picture and the best checkpoint's sha256 to TensorBoard or MLflow.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path

from features.bars import BarDataError, ColumnMap
from features.files import file_argument
from trainer.config import ConfigError, TrainConfig, add_config_flags, config_from_args
from trainer.paths import RunPaths
from trainer.tracking import TrackingError, check_spec

log = logging.getLogger("trainer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parquet", required=True, help="bars: a parquet file or a directory of them")
    p.add_argument("--out", type=file_argument("ckpt.pt", {".onnx": "an ONNX model, which `python -m export` makes "
                                                                "from the checkpoint the trainer writes"}),
                   help="best checkpoint (default ckpt.pt; with --resume the resumed run's own, e.g. runs/ckpt.pt for "
                        "--resume runs/ckpt.last.pt); beside it: .last.pt, .metrics.jsonl, .report.png")
    p.add_argument("--config", help="TOML file of config fields (flags override it)")
    p.add_argument("--resume", type=Path, help="continue the run saved in this checkpoint (e.g. ckpt.last.pt)")
    p.add_argument("--plan-only", action="store_true",
                   help="print the memory plan (what fits the --vram-budget and what it costs) and exit")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none anyway where stderr is not a terminal)")
    p.add_argument("--no-report", action="store_true", help="skip the report picture")
    p.add_argument("--tracking", metavar="SCHEME:TARGET",
                   help="also log the run to tensorboard:DIR (event files under DIR/RUN; needs the extra "
                        "foxhunt-tft[tensorboard]) or mlflow:URI (an MLflow run named RUN; needs foxhunt-tft[mlflow])")
    p.add_argument("--tracking-run", metavar="RUN",
                   help="the tracked run's name (default: --out's stem, e.g. ckpt, which a resumed run shares)")
    ColumnMap.add_arguments(p)
    add_config_flags(p)
    return p


def default_out(resume: Path | None) -> Path | None:
    """--out when not given: ckpt.pt, or a resumed run's own best checkpoint (runs/ckpt.pt beside
    runs/ckpt.last.pt). None for a resumed file of another name: where its run wrote is unknown."""
    if resume is None:
        return Path("ckpt.pt")
    if resume.name.endswith(".last.pt"):
        return resume.with_name(resume.name.removesuffix(".last.pt") + ".pt")
    return None


def _stat(path: Path) -> tuple[int, int, int] | None:
    """What tells one version of a file from another: inode, size and modification time (None: no file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def continue_command(command: list[str], last: Path) -> str:
    """The run's own `command` resuming from `last`, quoted for a shell."""
    kept: list[str] = []
    args = iter(command)
    for arg in args:
        if arg == "--resume":
            next(args, None)  # its value
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return shlex.join([*kept, "--resume", str(last)])


def _where_to_continue(args: argparse.Namespace, before: tuple[int, int, int] | None) -> str:
    """After Ctrl-C or SIGTERM: the command that continues from the last checkpoint, if there is one."""
    last = RunPaths.for_out(args.out).last
    now = _stat(last)
    if now is not None and now != before:
        return f"the last epoch's checkpoint is intact; continue with `{continue_command(args.command, last)}`"
    if args.resume is not None:
        return (f"no epoch finished, so nothing was saved; {args.resume} is as it was: continue with "
                f"`{continue_command(args.command, args.resume)}`")
    return "no epoch finished, so nothing was saved (files already beside --out are an earlier run's); start again"


def _check_early(args: argparse.Namespace) -> None:
    """--parquet and --tracking, checked before torch is imported."""
    if not Path(args.parquet).exists():
        raise ConfigError(f"--parquet {args.parquet}: no such file or directory; pass a parquet file or a directory "
                          "of them")
    if args.tracking is not None:
        check_spec(args.tracking)


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: rank 0 tells the run; the others only what goes wrong
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s " + (f"[rank {rank}] " if rank else "") + "%(message)s")
    p = build_parser()
    args = p.parse_args(argv)
    args.out = args.out or default_out(args.resume)
    if args.out is None:
        p.error(f"--resume {args.resume}: give --out (where the run's best checkpoint goes): the resumed file is not "
                "a run's own ckpt.last.pt, so where its run wrote is unknown")
    args.command = ["python", "-m", "trainer", *(sys.argv[1:] if argv is None else argv)]
    try:
        _check_early(args)  # said first, not under the resolved config and the device choice
        cfg = config_from_args(args)
    except (ConfigError, TrackingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    before = _stat(RunPaths.for_out(args.out).last)  # a last checkpoint that differs from this at the end is ours
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: KeyboardInterrupt
    try:
        return _train(args, cfg)
    except KeyboardInterrupt:
        print(f"interrupted: {_where_to_continue(args, before)}", file=sys.stderr)
        return 130


def _train(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """The run, its errors told in a line each; torch is imported here, so --help answers fast."""
    # expandable segments keep reserved memory (what the cap bounds) close to allocated (what the plan estimates)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from trainer.run import RUN_ERRORS, run_training

    try:
        return run_training(args, cfg)
    except BarDataError as exc:
        print(f"error: {exc.summary(args.parquet)}", file=sys.stderr)
        return 2
    except RUN_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as exc:
        print(_device_memory_error(args, exc), file=sys.stderr)
        return 3
    except (RuntimeError, MemoryError) as exc:  # the host's memory: torch's allocator (a RuntimeError), numpy's
        if isinstance(exc, RuntimeError) and "can't allocate memory" not in str(exc):
            raise
        print(_host_memory_error(exc), file=sys.stderr)
        return 3
    except (OSError, TrackingError) as exc:  # a file, or the tracking server, that cannot take the run's output
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _device_memory_error(args: argparse.Namespace, exc: Exception) -> str:
    last = RunPaths.for_out(Path(str(args.out))).last
    return (f"error: out of device memory with nothing left to halve (a micro-batch of 1 window, under torchrun the "
            f"micro-batch exchanging gradients, or outside a training step): {str(exc).splitlines()[0]}. The last "
            f"good checkpoint (if any epoch finished) is intact: {last}. Shrink the model or give the run more memory "
            "(--vram-budget, or a card with more free memory)")


def _host_memory_error(exc: Exception) -> str:
    what = str(exc).split(". ", 1)[-1].splitlines()[0] if str(exc) else type(exc).__name__
    return (f"error: out of host memory: {what}. Shrink the model (--hidden-size, --encoder-length), --batch-size or "
            "the bars (fewer symbols or years, --max-val-windows), or give the run more memory")


if __name__ == "__main__":
    raise SystemExit(main())
