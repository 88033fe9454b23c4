"""From parsed arguments to a finished run: the VRAM budget, the plan, training, the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from features.bars import ColumnMap
from features.files import atomic_output
from features.metrics import format_q_risk
from trainer.checkpoint import CheckpointError, file_sha256, load_checkpoint
from trainer.config import ConfigError, TrainConfig, given_fields, resumed_config, setting_label
from trainer.data import DataError, PreparedData, ReadBars, prepare
from trainer.device import DeviceError, no_cuda_reason, resolve_device, resolve_precision
from trainer.distributed import shutdown
from trainer.loop import PlanFn, Trainer, TrainingDiverged, TrainResult, build_model
from trainer.modeling import TemporalFusionTransformer
from trainer.paths import run_stem
from trainer.plan import TrainPlan
from trainer.planner import PlanError, Target, batch_fn_for, format_bytes, parse_budget, plan_for_model
from trainer.report import write_report
from trainer.resume import ResumeState
from trainer.run_files import runs_best
from trainer.tracking import Tracker, epoch_scalars, forecast_scalars, open_tracker

log = logging.getLogger("trainer")

REPORT_WINDOWS = 512
# what a run refuses or stops on with a message that says what to change
RUN_ERRORS = (ConfigError, DataError, DeviceError, CheckpointError, PlanError, TrainingDiverged)


def run_training(args: argparse.Namespace, cfg: TrainConfig) -> int:
    resumed = ResumeState.load(args.resume) if args.resume else None
    if resumed is not None:  # the checkpoint's recipe; ConfigError naming each setting of this command that changes it
        stored = TrainConfig.from_dict(resumed.ckpt["train_config"])
        cfg = resumed_config(stored, cfg, given_fields(args), setting_label(args))
    columns = ColumnMap.from_args(args, resumed.ckpt["column_map"] if resumed else None)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, once
        print("resolved config:\n" + json.dumps(cfg.to_dict(), indent=2), file=sys.stderr)
    if args.plan_only:
        return plan_only(args.parquet, cfg, parse_budget(cfg.vram_budget) if cfg.vram_budget else 0, columns,
                         resumed)
    train(args.parquet, cfg, Path(args.out), columns, resumed, progress=not args.no_progress,
          report=not args.no_report, tracking=args.tracking, tracking_run=args.tracking_run,
          budget_label=(f"vram_budget = {cfg.vram_budget!r} (from --config {args.config})"
                        if args.cfg_vram_budget is None and args.config else None))  # None: the flag
    return 0


def train(source: str | Path | ReadBars, cfg: TrainConfig, out: Path, columns: ColumnMap,
          resumed: ResumeState | None = None, progress: bool = True, report: bool = True, tracking: str | None = None,
          tracking_run: str | None = None, budget_label: str | None = None) -> TrainResult:
    """A run as `python -m trainer` runs it once its arguments are read: the VRAM plan, the epochs, the best
    model's report and test scores, each logged to `tracking` (as --tracking) in the run `tracking_run` (default:
    `out`'s stem). `budget_label`: how the budget was set, for messages (default: the flag)."""
    budget = parse_budget(cfg.vram_budget) if cfg.vram_budget else 0
    label = budget_label or f"--vram-budget {cfg.vram_budget}"
    if budget and cfg.device == "cpu":
        log.warning("%s is not applicable on the CPU (it caps CUDA device memory): training runs without it", label)
        budget = 0
    plan_fn = budget_plan_fn(budget, cfg, label) if budget else None
    trainer = Trainer(source, cfg, out, columns, resume=resumed, progress=progress, plan_fn=plan_fn)
    with _tracker(tracking, tracking_run or run_stem(out), trainer) as tracker:  # rank 0 logs as they come
        on_epoch = None if tracker is None else lambda r: tracker.log_metrics(epoch_scalars(r), int(r["epoch"]))
        result = trainer.run(on_epoch=on_epoch)
        if trainer.dist.is_main and result.history:  # rank 0 alone writes files
            _judge_best(trainer, report=report, tracker=tracker)
    log.info("best validation loss %.5f at epoch %d; checkpoint %s (resume from %s), metrics %s%s",
             trainer.best_val, trainer.best_epoch, result.paths.best, result.paths.last, result.paths.metrics,
             f", report {result.paths.report}" if report else "")
    shutdown(trainer.dist)  # under torchrun: the process group torn down, not left to the interpreter's exit
    return result


@contextlib.contextmanager
def _tracker(spec: str | None, run: str, trainer: Trainer) -> Iterator[Tracker | None]:
    """The tracker of --tracking on rank 0 (else None), the config logged; closed however the run ends."""
    if spec is None or not trainer.dist.is_main:
        yield None
        return
    tracker = open_tracker(spec, run)
    try:
        tracker.log_params({"parquet": trainer.parquet, **trainer.cfg.to_dict()})
        yield tracker
    finally:
        tracker.close()


def _judge_best(trainer: Trainer, report: bool, tracker: Tracker | None = None) -> None:
    """The best checkpoint's report and test scores when it is at --out; with a tracker, they and its sha256 logged."""
    wanted = [what for what, on in (("the report", report), ("the test split", trainer.data.test_anchors.size > 0),
                                    ("the tracked checkpoint sha256", tracker is not None)) if on]
    if not wanted:
        return
    best = runs_best(trainer.paths.best, trainer.best_epoch, trainer.history)
    if best is None:  # a resumed run whose best is elsewhere (said at its start), or a file replaced since
        log.warning("skipped %s: %s is not this run's best checkpoint (epoch %d)", " and ".join(wanted),
                    trainer.paths.best, trainer.best_epoch)
        return
    if report:
        _report(trainer, best)
    test = test_best(trainer, best) if trainer.data.test_anchors.size else None
    if tracker is not None:
        _track_best(tracker, trainer, report, test)


def _track_best(tracker: Tracker, trainer: Trainer, report: bool, test: dict[str, Any] | None) -> None:
    """The best checkpoint's path, epoch and sha256 as tags, its report, its test scores at step = its epoch."""
    tracker.set_tag("checkpoint", str(trainer.paths.best))
    tracker.set_tag("best_epoch", str(trainer.best_epoch))
    tracker.set_tag("checkpoint_sha256", file_sha256(trainer.paths.best))
    if report:
        tracker.log_image("report", trainer.paths.report)
    if test is not None:
        tracker.log_metrics({"loss/test": test["test_loss"], **forecast_scalars("test", test["test"])},
                            test["epoch"])


def budget_plan_fn(budget: int, cfg: TrainConfig, label: str) -> PlanFn:
    """The Trainer's plan_fn for a VRAM budget set as `label` says; PlanError without CUDA."""
    if not torch.cuda.is_available():
        raise PlanError(f"{label} caps CUDA device memory, but CUDA is not available here ({no_cuda_reason()}), so "
                        "the budget cannot be kept. Use --plan-only to see the plan for a CUDA card, or --device cpu "
                        "to train on the CPU without a budget")

    def plan_on_cuda(model: TemporalFusionTransformer, data: PreparedData, device: torch.device,
                     precision: str) -> TrainPlan:
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, budget / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device)  # indexed: resolve_device always names one
        log.info("VRAM cap: torch.cuda.set_per_process_memory_fraction(%.4f) = %s of %s on %s", fraction,
                 format_bytes(fraction * total), format_bytes(total), torch.cuda.get_device_name(device))
        target = Target("cuda", device, precision, f"{torch.cuda.get_device_name(device)}, {format_bytes(total)}")
        effective, notes = _card_budget(budget, device)
        report = plan_for_model(model, batch_fn_for(data.tensors, data.train_anchors), target, effective,
                                cfg.batch_size, cfg.grad_checkpointing, sys.stderr)
        return replace(report.plan, budget_bytes=budget, notes=(*notes, *report.plan.notes))

    return plan_on_cuda


def _card_budget(budget: int, device: torch.device) -> tuple[int, tuple[str, ...]]:
    """The budget, or what the card has available if that is less (other processes, a smaller card)."""
    free, total = torch.cuda.mem_get_info(device)
    available = int(free) + int(torch.cuda.memory_reserved(device))
    if available >= budget:
        return budget, ()
    note = (f"the card has {format_bytes(available)} available of {format_bytes(total)}, less than the "
            f"{format_bytes(budget)} budget: planning for {format_bytes(available)}")
    log.warning("%s", note)
    return available, (note,)


def plan_only(parquet: str, cfg: TrainConfig, budget: int, columns: ColumnMap, resumed: ResumeState | None) -> int:
    """--plan-only: measure, print the plan for the device the run would use and exit 0, on any machine
    (without CUDA, --device cuda or auto with a budget plans for a card from a CPU measurement)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data = prepare(parquet, cfg, columns, *resumed.vocabulary()) if resumed else prepare(parquet, cfg, columns)
    target = _plan_target(cfg, budget)
    model = build_model(cfg, data, target.measure_device)
    notes: tuple[str, ...] = ()
    if budget and target.measure_device.type == "cuda":
        budget, notes = _card_budget(budget, target.measure_device)
    report = plan_for_model(model, batch_fn_for(data.tensors, data.train_anchors), target, budget, cfg.batch_size,
                            cfg.grad_checkpointing, sys.stdout)
    for note in notes:
        print(note)
    log.info("plan only: micro-batch %d x %d accumulation, gradient checkpointing %s, estimated peak %s (%.1f s)",
             report.plan.micro_batch, report.plan.accumulation, "on" if report.plan.grad_checkpointing else "off",
             format_bytes(report.plan.estimate_bytes), report.seconds)
    return 0


def _plan_target(cfg: TrainConfig, budget: int) -> Target:
    """The device --plan-only plans for, and where it measures: the card when there is one, else the CPU."""
    cpu = torch.device("cpu")
    cuda_here = torch.cuda.is_available()
    wants_cuda = cfg.device.startswith("cuda") or (cfg.device == "auto" and (cuda_here or budget > 0))
    if wants_cuda and cuda_here:
        device = resolve_device("cuda" if cfg.device == "auto" else cfg.device)
        total = torch.cuda.get_device_properties(device).total_memory
        name = f"{torch.cuda.get_device_name(device)}, {format_bytes(total)}"
        return Target("cuda", device, resolve_precision(cfg.precision, device), f"{name}: measured on it")
    if wants_cuda:
        why = "--device auto with a VRAM budget" if cfg.device == "auto" else f"--device {cfg.device}"
        return Target("cuda", cpu, "bf16" if cfg.precision == "auto" else cfg.precision,
                      f"{why}; no CUDA here ({no_cuda_reason()}): planned for a CUDA card from a CPU measurement")
    return Target("cpu", cpu, resolve_precision(cfg.precision, cpu),
                  "--device auto: no CUDA here" if cfg.device == "auto" else "--device cpu")


def test_best(trainer: Trainer, best: dict[str, Any] | None = None) -> dict[str, Any]:
    """The best checkpoint's metrics on the held-out test split, logged and written beside it."""
    best = best if best is not None else load_checkpoint(trainer.paths.best)
    trainer.model.load_state_dict(best["model_state"])
    result = {"epoch": int(best["epoch"]), **trainer.evaluate(trainer.data.test_anchors, "test")}
    with atomic_output(trainer.paths.test) as tmp:  # written whole or not at all, Ctrl-C included
        Path(tmp).write_text(json.dumps(result, indent=2) + "\n")
    t, b = result["test"], result["baseline"]
    log.info("test split, best model (epoch %d), %d windows: loss %.4f; coverage model %.1f%% baseline %.1f%% "
             "(nominal %.0f%%); q-risk model/baseline %s -> %s", result["epoch"], result["test_windows"],
             result["test_loss"], 100 * t["coverage"], 100 * b["coverage"], 100 * t["nominal_coverage"],
             format_q_risk(t["q_risk"], b["q_risk"]), trainer.paths.test)
    return result


def _report(trainer: Trainer, best: dict[str, Any]) -> None:
    """The report shows the best model, as exported, on consecutive validation windows."""
    trainer.model.load_state_dict(best["model_state"])
    anchors = trainer.data.val_anchors[:REPORT_WINDOWS]
    outputs = trainer.predict(anchors)
    schema = trainer.data.frame.schema
    write_report(trainer.paths.report, trainer.history, outputs, trainer.data.frame.targets[anchors],
                 tuple(trainer.cfg.quantiles), schema.observed, schema.known, schema.static)
