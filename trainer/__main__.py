"""`python -m trainer --parquet bars.parquet`: train a TFT and write a resumable checkpoint.

Exit status: 0 done, 1 an output could not be written (e.g. disk full, or --out not writable,
found before training; the previous checkpoint is intact), 2 bad arguments, config or data, a
VRAM budget that cannot hold the run, or a loss that became NaN or infinite (one clear message,
no traceback; nothing of the diverged epoch is saved), 3 out of device memory with nothing left to
halve (or out of host memory), 130 interrupted (the last good checkpoint is intact either way).

`--vram-budget 4GiB` plans micro-batch, accumulation and gradient checkpointing to fit the
budget and caps the process's CUDA memory to it; `--plan-only` prints that plan and exits,
on any machine (without CUDA it plans for a CUDA card from a CPU measurement).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from types import FrameType


def _stopped_while_loading(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"interrupted; nothing was saved.\n")
    os._exit(130)


if __name__ == "__main__":  # a stop signal while the modules below import (pyarrow, numpy) ends the run in one
    for _sig in (signal.SIGINT, signal.SIGTERM):  # line, exit 130, as one later does; main sets its own handlers
        signal.signal(_sig, _stopped_while_loading)

# Before CUDA starts: expandable segments let the caching allocator grow and shrink its pool
# instead of holding fixed blocks, so reserved memory (what the VRAM cap bounds) stays close to
# allocated memory (what the plan estimates). A user's own setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from features.bars import BarDataError, ColumnMap
from features.files import file_argument
from features.stopping import stop_ends_the_import
from trainer.config import ConfigError, TrainConfig, add_config_flags, config_from_args
from trainer.paths import RunPaths

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
    ColumnMap.add_arguments(p)
    add_config_flags(p)
    return p


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def default_out(resume: Path | None) -> Path | None:
    """--out when not given: ckpt.pt, or a resumed run's own best checkpoint (runs/ckpt.pt beside
    runs/ckpt.last.pt), so that it goes on writing where it did, not in the working directory. None for a
    resumed file of another name (a copy, a link): where its run wrote is unknown, and --out must say."""
    if resume is None:
        return Path("ckpt.pt")
    if resume.name.endswith(".last.pt") and not resume.is_symlink():
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
    """`command` (the run's own, flags and all: the recipe flags equal the checkpoint's, and the machine flags
    are what a resume takes from its command) resuming from `last`, quoted for a shell."""
    kept: list[str] = []
    skip = False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return shlex.join([*kept, "--resume", str(last)])


def _where_to_continue(args: argparse.Namespace, before: tuple[int, int, int] | None) -> str:
    """After Ctrl-C or SIGTERM: the command that continues, from the last checkpoint this run wrote; else the one
    it resumed from, which is as it was; else there is none."""
    last = RunPaths.for_out(args.out).last
    now = _stat(last)
    if now is not None and now != before:
        return f"the last epoch's checkpoint is intact; continue with `{continue_command(args.command, last)}`"
    if args.resume is not None:
        return (f"no epoch finished, so nothing was saved; {args.resume} is as it was: continue with "
                f"`{continue_command(args.command, args.resume)}`")
    return "no epoch finished, so nothing was saved (files already beside --out are an earlier run's); start again"


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: rank 0 tells the run; the others only what goes wrong
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s " + (f"[rank {rank}] " if rank else "") + "%(message)s")
    p = build_parser()
    args = p.parse_args(argv)
    args.out = args.out or default_out(args.resume)
    if args.out is None:
        p.error(f"--resume {args.resume}: give --out (where the run's best checkpoint goes; its latest goes beside "
                f"it as .last.pt): the resumed file is not a run's own ckpt.last.pt, so where its run wrote is "
                "unknown, and writing over the file itself would lose it")
    if not Path(args.parquet).exists():  # said first, not under the resolved config and the device choice
        print(f"error: --parquet {args.parquet}: no such file or directory; pass a parquet file or a directory "
              "of them", file=sys.stderr)
        return 2
    args.command = ["python", "-m", "trainer", *(sys.argv[1:] if argv is None else argv)]
    before = _stat(RunPaths.for_out(args.out).last)  # a last checkpoint that differs from this at the end is ours
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        cfg = config_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _train(args, cfg, before)


def _train(args: argparse.Namespace, cfg: TrainConfig, before: tuple[int, int, int] | None) -> int:
    """The run, its errors told in a line each. Torch is imported only here, once the flags and the config
    hold: --help and a bad flag answer in a moment, not after torch's seconds of import."""
    with stop_ends_the_import(f"interrupted: {_where_to_continue(args, before)}"):
        import torch

        from trainer.checkpoint import CheckpointError
        from trainer.data import DataError
        from trainer.device import DeviceError
        from trainer.loop import TrainingDiverged
        from trainer.planner import PlanError
        from trainer.run import run_training
    try:
        return run_training(args, cfg)
    except BarDataError as exc:
        print(f"error: {args.parquet}: {len(exc.problems)} problem(s) in the bars:", file=sys.stderr)
        for line in exc.lines():
            print(f"  {line}", file=sys.stderr)
        return 2
    except (ConfigError, DataError, DeviceError, CheckpointError, PlanError, TrainingDiverged) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as exc:
        last = RunPaths.for_out(Path(str(args.out))).last
        print(f"error: out of device memory with nothing left to halve (a micro-batch of 1 window, under "
              f"torchrun the micro-batch exchanging gradients, or outside a training step): "
              f"{str(exc).splitlines()[0]}. The last good checkpoint (if any epoch finished) is intact: "
              f"{last}. Shrink the model or give the run more memory (--vram-budget, or a card with more free "
              "memory)", file=sys.stderr)
        return 3
    except (RuntimeError, MemoryError) as exc:  # the host's memory: torch's allocator (a RuntimeError), numpy's
        if isinstance(exc, RuntimeError) and "can't allocate memory" not in str(exc):
            raise
        what = str(exc).split(". ", 1)[-1].splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: out of host memory: {what}. Shrink the model (--hidden-size, --encoder-length), "
              "--batch-size or the bars (fewer symbols or years, --max-val-windows), or give the run more memory",
              file=sys.stderr)
        return 3
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {_where_to_continue(args, before)}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here, Ctrl-C as usual (SIGTERM: set in main)
    try:
        status = main()
    except KeyboardInterrupt:  # while the flags were read, before the run's own handling began
        print("interrupted; nothing was saved.", file=sys.stderr)
        status = 130
    raise SystemExit(status)

