"""The training loop: AdamW, warm-up + cosine schedule, clipping, early stopping, exact resume.

Device, precision and the memory plan are decided once before the first step; the loop
itself has no device branches (an autocast factory and a GradScaler that may be disabled).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from features import package_version
from features.bars import ColumnMap, clash_with_bars
from features.file_kind import replace_problem
from features.files import unwritable
from features.metrics import climatology_forecast, forecast_metrics, format_q_risk, pinball
from features.schema import MODEL_OUTPUTS, QUANTILES, TARGET
from trainer.checkpoint import (
    FORMAT,
    CheckpointError,
    copy_atomic,
    load_checkpoint,
    remove_stale_temp_files,
    save_atomic,
    state_digest,
)
from trainer.config import RESUME_OVERRIDABLE, STOPPING_RULES, ConfigError, TrainConfig, resumed_config
from trainer.data import (
    ROW_INPUTS,
    Normalization,
    PreparedData,
    check_resumed_bars,
    check_resumed_split,
    prepare,
)
from trainer.device import PeakMemory, autocast_factory, check_placement, resolve_device, resolve_precision
from trainer.distributed import init_from_env
from trainer.loss import pinball_loss
from trainer.modeling import RowsForward, TemporalFusionTransformer, TFTOutput
from trainer.paths import RUN_FILES, RunPaths, run_stem
from trainer.plan import TrainPlan, literal_plan

log = logging.getLogger("trainer")

VALIDATION_SAMPLE_WINDOWS = 256


@dataclass
class TrainResult:
    paths: RunPaths
    history: list[dict[str, Any]]
    best_val_loss: float
    epochs_run: int
    stopped_early: bool
    plan: TrainPlan
    extra: dict[str, Any] = field(default_factory=dict)


def lr_lambda_factory(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10% of the peak."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def normalized_loss(out: TFTOutput, target: torch.Tensor, quantiles: torch.Tensor,
                    target_scale: torch.Tensor) -> torch.Tensor:
    """Pinball loss in units of each horizon's target std (a scale-free objective)."""
    pred = out.quantiles.float() / target_scale[None, :, None]  # [B, H, Q]
    return pinball_loss(pred, target / target_scale[None, :], quantiles).mean()


class TrainingDiverged(ValueError):
    """The loss became NaN or infinite: nothing of that epoch is saved; the message says what to change."""


def check_output(out: Path) -> None:
    """Where the checkpoints go is usable, found before any training: OSError naming --out otherwise. Creates
    nothing (a run refused later, e.g. for its data, leaves no empty directory): the run makes out's
    directory when it starts writing; here its nearest existing ancestor must take a file."""
    if out.is_dir():
        raise OSError(f"--out {out} is a directory; give the checkpoint's file name, e.g. {out / 'ckpt.pt'}")
    if problem := unwritable(out):
        raise OSError(f"--out {out}: cannot write in {problem[0]} ({problem[1]}); give a directory this user can "
                      "write to")


class Trainer:
    """One training run; `run()` trains until the epochs end or validation stops improving."""

    def __init__(self, parquet: str | Path, cfg: TrainConfig, out: Path, columns: ColumnMap | None = None,
                 resume: Path | None = None, progress: bool = True,
                 plan_fn: Callable[[TemporalFusionTransformer, PreparedData, torch.device, str], TrainPlan]
                 | None = None) -> None:
        self.paths = RunPaths.for_out(out)
        check_output(out)
        for role, written in zip(RUN_FILES, astuple(self.paths), strict=True):
            if problem := clash_with_bars(written, Path(parquet)):
                raise ConfigError(f"--out {out}: {problem}; give another --out")
            if written.is_dir():  # found now, not when the first epoch's files are written
                raise OSError(f"--out {out}: {written}, where the run writes its {role}, is a directory; remove it "
                              "or give another --out")
        if out.name.endswith(".last.pt"):  # RunPaths would put the latest epoch in x.last.last.pt
            raise ConfigError(f"--out {out} names the latest epoch's file; give the best checkpoint's name, "
                              f"{out.with_name(out.name.removesuffix('.last.pt') + '.pt')}, beside which the run "
                              f"writes {out.name}")
        for checkpoint in (self.paths.best, self.paths.last):  # an earlier run's may be replaced, nothing else
            if problem := replace_problem(checkpoint, "a PyTorch checkpoint"):
                raise ConfigError(f"--out {out}: {problem}")
        written_whole = (self.paths.best, self.paths.last, self.paths.report, self.paths.test)  # through temp files
        for stale in (found for path in written_whole for found in remove_stale_temp_files(path)):
            log.warning("removed %s, a partial write left by a killed run", stale)
        self.progress = progress
        self.columns = columns or ColumnMap()
        self.resume_state: dict[str, Any] | None = None
        self.resume_path = resume
        if resume is not None:
            self.resume_state = load_checkpoint(resume)
            stored = TrainConfig.from_checkpoint(self.resume_state["train_config"])
            for rule in STOPPING_RULES:
                if getattr(cfg, rule) != getattr(stored, rule):
                    log.info("resume: %s %d -> %d", rule, getattr(stored, rule), getattr(cfg, rule))
            # the run's recipe comes from the checkpoint; the hardware it runs on and its epochs from `cfg`
            cfg = resumed_config(stored, cfg, set(RESUME_OVERRIDABLE))
            if columns is None:  # else the caller laid its flags over the stored names (ColumnMap.from_args)
                self.columns = ColumnMap.from_dict(self.resume_state.get("column_map", {}))
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.dist = init_from_env(cfg.device)
        if cfg.batch_size < self.dist.world_size:  # every rank takes a share of each step's windows
            raise ConfigError(f"--batch-size {cfg.batch_size} is smaller than the {self.dist.world_size} processes "
                              f"torchrun started: each needs a window of every step; raise it to at least "
                              f"{self.dist.world_size}")
        self.progress = progress and self.dist.is_main
        self.device = resolve_device(self.dist.device_spec(cfg.device))
        self.precision = resolve_precision(cfg.precision, self.device)
        norm = (Normalization.from_dict(self.resume_state["normalization"]) if self.resume_state else None)
        symbols = list(self.resume_state["symbols"]) if self.resume_state else None
        if self.dist.enabled and norm is None:  # rank 0 fits vocabulary and normalisation; all ranks share them
            def fitted() -> tuple[list[str], dict[str, Any]]:
                first = prepare(parquet, cfg, self.columns)
                return first.frame.symbols, first.normalization.to_dict()

            symbols, norm_dict = self.dist.from_main(fitted)
            norm = Normalization.from_dict(norm_dict)
        self.data = prepare(parquet, cfg, self.columns, symbols, norm)
        if self.resume_state is not None:
            source = str(self.resume_state.get("data_source", "not recorded"))
            check_resumed_split(self.resume_state.get("split_times_ns"), self.data.split_times_ns, cfg.test_fraction,
                                source)
            check_resumed_bars(self.resume_state.get("bars_digest"), self.data.bars_digest, source)
        self.parquet = str(parquet)
        frame = self.data.frame
        self.model_config = cfg.model_config(len(frame.schema.observed), len(frame.schema.known),
                                             len(frame.symbols))
        self.model = TemporalFusionTransformer(self.model_config)
        n = self.data.normalization
        self.model.set_normalization(n.observed.mean, n.observed.std, n.known.mean, n.known.std, n.target_scale)
        self.model.to(self.device)
        self.rows_model = RowsForward(self.model)  # training and validation run the shared-bar forward
        self.net: torch.nn.Module = self.rows_model
        if self.dist.enabled:
            # buffers (the normalisation, the attention mask) are equal on every rank and never change: not
            # broadcast at each forward, so a forward holds no collective and one that runs out of memory is retried.
            # Gradients are views into DDP's buckets (kept between steps), not a second copy the plan never counted.
            self.net = DistributedDataParallel(self.rows_model, device_ids=[self.device.index]
                                               if self.device.type == "cuda" else None, broadcast_buffers=False,
                                               gradient_as_bucket_view=True)
        self.plan = (plan_fn(self.model, self.data, self.device, self.precision.name) if plan_fn
                     else literal_plan(cfg.batch_size, cfg.grad_checkpointing, self.precision.name))
        self.model.gradient_checkpointing = self.plan.grad_checkpointing
        self.quantiles = torch.tensor(cfg.quantiles, dtype=torch.float32, device=self.device)
        self.target_scale = torch.from_numpy(n.target_scale).to(self.device)
        self.autocast = autocast_factory(self.device, self.precision)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay, fused=True)
        self.steps_per_epoch = self._steps_per_epoch()
        self.schedule_steps, self.schedule_epochs = self._schedule()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda_factory(cfg.warmup_steps, self.schedule_steps))
        if cfg.warmup_steps >= self.schedule_steps and self.dist.is_main and self.resume_state is None:
            log.warning("warmup_steps %d >= the run's %d optimizer steps: the learning rate never reaches its peak "
                        "(%g) nor decays; lower --warmup-steps", cfg.warmup_steps, self.schedule_steps,
                        cfg.learning_rate)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.needs_scaler)
        self.memory = PeakMemory(self.device)
        self.epoch = 0
        self.step = 0
        self._exchange_armed = False  # set by micro_step: an OOM after it, in the exchanging micro-batch, is fatal
        self.history: list[dict[str, Any]] = []
        self.best_val = math.inf
        self.best_epoch = 0
        self.stale_epochs = 0
        if self.resume_state is not None:
            self._restore(self.resume_state)

    # ---- set-up ----------------------------------------------------------------------
    def _steps_per_epoch(self) -> int:
        n, b = self.data.train_anchors.size, self.cfg.batch_size
        # a last step too small to give each rank a window is dropped (_epoch_anchors cuts the epoch to these steps)
        full = n // b + (n % b >= self.dist.world_size)
        return min(full, self.cfg.max_steps_per_epoch) if self.cfg.max_steps_per_epoch else full

    def _schedule(self) -> tuple[int, int]:
        """The optimizer steps and the epochs that the warm-up + cosine schedule spans: this run's `epochs`, and on
        resume the resumed run's own, whatever --epochs says now. A resume that trains past them does so at the
        schedule's floor instead of stretching the cosine, which would jump the learning rate back up mid-run."""
        if self.resume_state is None:
            return self.cfg.epochs * self.steps_per_epoch, self.cfg.epochs
        steps, epochs = self.resume_state.get("schedule_steps"), self.resume_state.get("schedule_epochs")
        if epochs is None and steps is not None:  # saved with its steps only
            epochs = round(int(steps) / max(1, self.steps_per_epoch))
        if epochs is None:  # a checkpoint from before the schedule was saved: its run's epochs
            epochs = TrainConfig.from_checkpoint(self.resume_state["train_config"]).epochs
        steps = int(steps if steps is not None else int(epochs) * self.steps_per_epoch)
        if self.cfg.epochs > int(epochs) and self.dist.is_main:
            log.warning("--epochs %d goes past the resumed run's learning-rate schedule (%d epochs, %d optimizer "
                        "steps): the schedule is kept, so the steps after it train at its floor, %.3g (10%% of the "
                        "peak); for a longer cosine, start a new run with --epochs %d", self.cfg.epochs, int(epochs),
                        steps, 0.1 * self.cfg.learning_rate, self.cfg.epochs)
        return steps, int(epochs)

    def _restore(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model_state"])
        self.optimizer.load_state_dict(ckpt["optimizer_state"])
        self.scheduler.load_state_dict(ckpt["scheduler_state"])
        self.scaler.load_state_dict(ckpt["scaler_state"])
        self.epoch, self.step = int(ckpt["epoch"]), int(ckpt["step"])
        self.history = list(ckpt["metrics_history"])
        self.best_val, self.best_epoch = float(ckpt["best_val_loss"]), int(ckpt["best_epoch"])
        self.stale_epochs = int(ckpt["epochs_without_improvement"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if self.device.type == "cuda" and ckpt["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(list(ckpt["rng"]["cuda"]))
        log.info("resumed from epoch %d, step %d (best validation loss %.5f at epoch %d)", self.epoch, self.step,
                 self.best_val, self.best_epoch)
        if self.dist.is_main and (later := self._later_last_epoch()):
            log.warning("resuming from epoch %d, but %s is at epoch %d: this run trains from epoch %d again and "
                        "replaces it as its epochs finish (resume from %s to go on where the run stopped)", self.epoch,
                        self.paths.last, later, self.epoch + 1, self.paths.last)

    def _later_last_epoch(self) -> int:
        """The epoch of a last checkpoint at --out further along than the one resumed (resuming from a run's best
        checkpoint, say, with its latest beside it), else 0."""
        last = self.paths.last
        if self.resume_path is None or not last.is_file() or last.resolve() == self.resume_path.resolve():
            return 0
        try:  # the epoch alone: mapped, not read
            epoch = int(torch.load(last, map_location="cpu", weights_only=True, mmap=True)["epoch"])
        except Exception:  # not a checkpoint of ours (the run replaces it either way)
            return 0
        return epoch if epoch > self.epoch else 0

    # ---- one epoch ---------------------------------------------------------------------
    def _epoch_anchors(self) -> torch.Tensor:
        """Training anchors shuffled in blocks of `block_windows` consecutive windows.

        Windows of one block overlap, so a batch holds fewer distinct bars than windows and
        the forward selects each bar's variables once (`forward_rows`). The order depends on
        (seed, epoch) only, so resume is exact; a block of 1 is a plain shuffle.
        """
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + self.epoch)
        anchors = torch.from_numpy(self.data.train_anchors)
        n, k = anchors.numel(), self.cfg.block_windows
        starts = torch.arange(0, n, k)[torch.randperm(math.ceil(n / k), generator=g)]  # [n_blocks]
        order = (starts[:, None] + torch.arange(k)).flatten()  # [n_blocks * k]
        order = order[order < n]  # the last block may be short
        return anchors[order][: self.steps_per_epoch * self.cfg.batch_size]

    def _forward(self, batch: dict[str, torch.Tensor], net: torch.nn.Module | None = None) -> TFTOutput:
        with self.autocast():
            out: TFTOutput = (net or self.rows_model)(*(batch[name] for name in ROW_INPUTS))
        return out

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nb = self.device.type == "cuda"
        return {k: v.to(self.device, non_blocking=nb) for k, v in batch.items()}

    def micro_step(self, anchors: torch.Tensor, weight: float) -> float:
        """Forward and backward of one micro-batch; returns its (unweighted) loss."""
        batch = self._to_device(self.data.tensors.row_batch(anchors))
        out = self._forward(batch, self.net)
        self._exchange_armed = True  # DDP's forward readied its gradient exchange, outside no_sync
        loss = normalized_loss(out, batch[TARGET], self.quantiles, self.target_scale)
        self.scaler.scale(loss * weight).backward()
        return float(loss.detach())

    def _zero_grad(self) -> None:
        """Gradients freed (one process) or zeroed in place (DDP: they are views into its buckets, which stay)."""
        self.optimizer.zero_grad(set_to_none=not self.dist.enabled)

    def _gradients_kept_local(self, local: bool) -> contextlib.AbstractContextManager[None]:
        """DDP's `no_sync` when `local` (the gradients accumulate on this rank alone), else nothing."""
        if local and isinstance(self.net, DistributedDataParallel):
            return self.net.no_sync()
        return contextlib.nullcontext()

    def _optimizer_step(self, anchors: torch.Tensor, step_windows: int) -> float:
        """One optimizer step over this rank's `anchors` (of the step's `step_windows`), in micro-batches;
        halves the micro-batch on OOM.

        Under torchrun, gradients are exchanged once a step, in the backward of the rank's last
        micro-batch (`no_sync` for the others): ranks may hold unequal shares, or have halved their
        micro-batch alone, and so make different numbers of micro-steps. Each micro-batch's loss is
        weighted by its share of the whole step times the ranks, so DDP's mean over ranks is the
        step's mean over its windows, as one process computes it.
        """
        scale = self.dist.world_size / step_windows
        while True:
            exchanging = False
            try:
                total = 0.0
                chunks = anchors.split(self.plan.micro_batch)
                for i, chunk in enumerate(chunks):
                    w = chunk.numel() * scale
                    exchanging = self.dist.enabled and i == len(chunks) - 1
                    self._exchange_armed = False
                    with self._gradients_kept_local(not exchanging):
                        total += self.micro_step(chunk, w) * chunk.numel() / anchors.numel()
                break
            except torch.OutOfMemoryError as exc:
                self._zero_grad()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                if exchanging and self._exchange_armed:  # other ranks may hold part of the exchange: no rerun
                    raise torch.OutOfMemoryError(
                        f"{str(exc).splitlines()[0]} (in the micro-batch whose backward exchanges gradients between "
                        f"the {self.dist.world_size} ranks, which cannot be retried at a smaller size)") from exc
                if self.plan.micro_batch <= 1:
                    raise
                self.plan = self.plan.halved()
                log.warning("out of memory: micro-batch halved to %d, accumulation %d steps (effective batch %d "
                            "kept)", self.plan.micro_batch, self.plan.accumulation, self.plan.batch_size)
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._zero_grad()
        self.scheduler.step()
        self.step += 1
        return total

    def train_epoch(self) -> dict[str, float]:
        self.model.train()
        anchors = self._epoch_anchors()
        losses: list[float] = []
        shares: list[float] = []  # this rank's windows over the step's, times the ranks (1 in one process)
        t0 = time.perf_counter()
        if self.dist.rank:  # dropout masks of their own on the other ranks; (seed, rank, epoch) keeps resume exact
            torch.manual_seed((self.cfg.seed * 1_000_003 + self.dist.rank) * 1_009 + self.epoch)
        # disable=None: no bar where stderr is not a terminal (a log file, a pipe), only the epoch lines
        bar = tqdm(total=anchors.numel(), unit="win", unit_scale=True, disable=None if self.progress else True,
                   leave=False, desc=f"epoch {self.epoch + 1}/{self.cfg.epochs}", dynamic_ncols=True)
        with bar:
            for step_anchors in anchors.split(self.cfg.batch_size):  # each gives every rank a window (_steps_per_epoch)
                mine = self.dist.shard(step_anchors)
                losses.append(self._optimizer_step(mine, step_anchors.numel()))
                shares.append(mine.numel() * self.dist.world_size / step_anchors.numel())
                bar.update(step_anchors.numel())
                bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}")
        seconds = time.perf_counter() - t0
        # a step whose loss overflowed is one fp16's gradient scaler skips (the weights stay as they were):
        # counted, and left out of the epoch's loss; only an epoch of nothing else is NaN here
        finite = [x * share for x, share in zip(losses, shares, strict=True) if math.isfinite(x)]
        if len(finite) < len(losses):
            log.warning("epoch %d: %d of %d steps had a non-finite loss", self.epoch + 1, len(losses) - len(finite),
                        len(losses))
        return {"train_loss": self.dist.mean(float(np.mean(finite)) if finite else math.nan),
                "nonfinite_steps": len(losses) - len(finite), "train_seconds": seconds,
                "windows_per_second": anchors.numel() / max(seconds, 1e-9)}

    @torch.inference_mode()
    def predict(self, anchors: np.ndarray, batch: int | None = None, outputs: tuple[str, ...] = MODEL_OUTPUTS
                ) -> dict[str, np.ndarray]:
        """The model's `outputs` on `anchors` (eval mode, no stored activations). Only those are kept: the
        explanations of every validation window would take far more memory than its quantiles."""
        if unknown := sorted(set(outputs) - set(MODEL_OUTPUTS)):
            raise ValueError(f"no model output named {', '.join(unknown)}; the outputs are {', '.join(MODEL_OUTPUTS)}")
        self.model.eval()
        size = batch or self.plan.val_batch
        while True:
            try:
                parts: dict[str, list[np.ndarray]] = {name: [] for name in outputs}
                for chunk in torch.from_numpy(anchors).split(size):
                    b = self._to_device(self.data.tensors.row_batch(chunk))
                    out = self._forward(b)._asdict()
                    for name, kept in parts.items():
                        kept.append(out[name].float().cpu().numpy())
                return {k: np.concatenate(v) for k, v in parts.items()}
            except torch.OutOfMemoryError:
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                if size <= 1:
                    raise
                size = max(1, size // 2)
                log.warning("out of memory in validation: validation batch halved to %d", size)

    def validate(self) -> dict[str, Any]:
        return self.evaluate(self.data.val_anchors, "val")

    def evaluate(self, anchors: np.ndarray, split: str) -> dict[str, Any]:
        """The model's loss and forecast metrics on these windows, beside the climatology baseline's:
        `{split}_loss`, `{split}` (metrics), `baseline`, `{split}_windows`."""
        pred = self.predict(anchors, outputs=(QUANTILES,))[QUANTILES]  # [W, H, Q]
        target = self.data.frame.targets[anchors]  # [W, H]
        scale = self.data.normalization.target_scale
        q = tuple(self.cfg.quantiles)
        loss = float((pinball(pred / scale[None, :, None], target / scale[None, :], np.asarray(q))).mean())
        base = climatology_forecast(self.data.climatology, anchors.size)
        return {f"{split}_loss": loss, split: forecast_metrics(pred, target, q),
                "baseline": forecast_metrics(base, target, q), f"{split}_windows": int(anchors.size)}

    # ---- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        frame = self.data.frame
        sample = self.data.tensors.batch(torch.from_numpy(self.data.val_anchors[:VALIDATION_SAMPLE_WINDOWS]))
        return {
            "format": FORMAT,
            "version": package_version(),
            "torch_version": str(torch.__version__),
            "model_config": self.model_config.to_dict(),
            "train_config": self.cfg.to_dict(),
            "feature_config": frame.config.to_dict(),
            "feature_schema": frame.schema.to_list(),
            "normalization": self.data.normalization.to_dict(),
            "symbols": list(frame.symbols),
            "bar_interval_ns": int(frame.bar_interval_ns),
            "column_map": self.columns.to_dict(),
            "data_source": self.parquet,
            "split_times_ns": list(self.data.split_times_ns),
            "data_span_ns": [int(frame.timestamp_ns.min()), int(frame.timestamp_ns.max())],  # the bars trained on
            "bars_digest": self.data.bars_digest,  # what a resume must read again
            "climatology": torch.from_numpy(self.data.climatology.copy()),
            "model_state": (weights := {k: v.detach().cpu() for k, v in self.model.state_dict().items()}),
            "model_state_sha256": state_digest(weights),
            "optimizer_state": self.optimizer.state_dict(),
            "scheduler_state": self.scheduler.state_dict(),
            "schedule_steps": self.schedule_steps,  # the schedule's length, kept by a resume with other --epochs
            "schedule_epochs": self.schedule_epochs,
            "scaler_state": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else []},
            "metrics_history": self.history,
            "peak_memory": [h["peak_memory"] for h in self.history],
            "best_val_loss": self.best_val,
            "best_epoch": self.best_epoch,
            "epochs_without_improvement": self.stale_epochs,
            "plan": self.plan.to_dict(),
            "validation_sample": {k: v.clone() for k, v in sample.items()},
        }

    # ---- the best checkpoint of this run -------------------------------------------------------
    def is_runs_best(self, ckpt: dict[str, Any]) -> bool:
        """Whether `ckpt` was saved by this run at its best epoch: its epochs are this run's first ones."""
        def trail(history: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
            return [(r.get("epoch"), r.get("step"), r.get("val_loss")) for r in history]

        kept = trail(list(ckpt.get("metrics_history") or []))
        same_epoch = 0 < self.best_epoch == int(ckpt.get("epoch", -1)) == len(kept)
        return same_epoch and kept == trail(self.history)[:len(kept)]

    def runs_best(self) -> dict[str, Any] | None:
        """The checkpoint at paths.best when it is this run's best; None when it is missing or another run's."""
        if not self.paths.best.is_file():
            return None
        try:
            ckpt = load_checkpoint(self.paths.best)
        except CheckpointError:
            return None
        return ckpt if self.is_runs_best(ckpt) else None

    def _adopt_best(self) -> None:
        """A resumed run writes its best checkpoint only when one of its own epochs beats the best so far. When
        --out is not where the run started, that file is missing or another run's: copy the run's best there
        from beside the resumed checkpoint, so that export, the report and the test split take this run's model."""
        resumed = self.resume_path
        if resumed is None or self.best_epoch == 0 or self.runs_best() is not None:
            return
        candidates = [resumed]
        if resumed.name.endswith(".last.pt"):  # NAME.last.pt beside its best: NAME, NAME.pt, .pth or .ckpt
            stem = resumed.name.removesuffix(".last.pt")  # (RunPaths), or NAME.<any> as runs named it before
            beside = sorted(p for p in resumed.parent.glob(f"{glob.escape(stem)}*")  # which is_runs_best tells
                            if stem in (run_stem(p), p.with_suffix("").name) and p != resumed)
            candidates = [*beside, resumed]
        for src in candidates:
            if not src.is_file() or src.resolve() == self.paths.best.resolve():
                continue
            try:
                found = self.is_runs_best(load_checkpoint(src))
            except CheckpointError:
                continue
            if found:
                copy_atomic(src, self.paths.best)
                log.info("resume: copied the run's best checkpoint (epoch %d) from %s to %s", self.best_epoch, src,
                         self.paths.best)
                return
        state = "holds another run's checkpoint" if self.paths.best.exists() else "does not exist"
        log.warning("resume: %s %s, and the run's best checkpoint (epoch %d, validation loss %.5f) is not beside %s "
                    "either; an epoch of this run that beats it will be written there. Until then there is no best "
                    "checkpoint of this run to export, report or test (copy it to %s to use it)", self.paths.best,
                    state, self.best_epoch, self.best_val, resumed, self.paths.best)
        self._remove_judgments("they judge a model that is not this run's best")

    def _remove_judgments(self, why: str) -> None:
        """The report and test scores in --out, which judge the model at paths.best, when that is not this
        run's (a fresh run, or a resumed one whose best is not to be found)."""
        if stale := [p for p in (self.paths.test, self.paths.report) if p.exists()]:
            for p in stale:
                p.unlink()
            log.warning("removed %s: %s", ", ".join(map(str, stale)), why)

    # ---- the run ------------------------------------------------------------------------------
    def run(self, stop_after_epochs: int | None = None) -> TrainResult:
        """Train; `stop_after_epochs` ends this process's part early (as an interruption would)."""
        stopped_early = False
        ran = 0
        log.info("plan: micro-batch %d x %d accumulation = batch %d, gradient checkpointing %s, %s",
                 self.plan.micro_batch, self.plan.accumulation, self.plan.batch_size,
                 "on" if self.plan.grad_checkpointing else "off", self.plan.precision)
        check_placement(self.model, self._to_device(self.data.tensors.batch(
            torch.from_numpy(self.data.train_anchors[:2]))), self.device)
        if self._patience_spent():
            stopped_early = True
        if self.dist.is_main and (stopped_early or self.epoch >= self.cfg.epochs):
            log.warning("nothing to train: %s", self._why_finished())
        metrics_mode = "a"
        if self.dist.is_main:  # metrics restart from the checkpoint's history, or afresh: one run per file
            self._adopt_best()
            if self.history:  # (a fresh run makes --out's directory with its first checkpoint: one that saves
                self.paths.metrics.parent.mkdir(parents=True, exist_ok=True)  # no epoch leaves none behind)
                self.paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in self.history))
            else:  # a fresh run replaces an earlier run's file once its first epoch is saved, as its checkpoints
                metrics_mode = "w"
            if self.resume_state is None and (old := [p for p in (self.paths.best, self.paths.last) if p.exists()]):
                log.warning("%s: from an earlier run; this run replaces them as its epochs finish",
                            ", ".join(str(p) for p in old))
        # a fresh run's report and test scores are its own, or none: an earlier run's go once this run's first
        # best checkpoint replaces the model they judge (an interrupted first epoch leaves them as they were)
        judged_elsewhere = self.dist.is_main and self.resume_state is None
        while self.epoch < self.cfg.epochs and not stopped_early:
            self.memory.start()
            train_stats = self.train_epoch()
            train_peak = self.memory.read()
            self.memory.start()
            # rank 0 validates and every rank takes its figures: the best epoch, early stopping and the
            # divergence check are decided alike everywhere (validation batches can differ between cards)
            val_stats = self.dist.from_main(self.validate)
            val_peak = self.memory.read()
            self._check_finite(train_stats["train_loss"], val_stats["val_loss"])
            self.epoch += 1
            ran += 1
            improved = val_stats["val_loss"] < self.best_val
            if improved:
                self.best_val, self.best_epoch, self.stale_epochs = val_stats["val_loss"], self.epoch, 0
            else:
                self.stale_epochs += 1
            record = {"epoch": self.epoch, "step": self.step, "lr": self.scheduler.get_last_lr()[0], **train_stats,
                      **val_stats, "micro_batch": self.plan.micro_batch,
                      "peak_memory": {"train": train_peak, "val": val_peak}, "best": improved}
            self.history.append(record)
            if self.dist.is_main:
                self._log_epoch(record)
                state = self.state()
                save_atomic(state, self.paths.last)
                if improved:
                    save_atomic(state, self.paths.best)
                    if judged_elsewhere:
                        self._remove_judgments("from an earlier run")
                        judged_elsewhere = False
                with self.paths.metrics.open(metrics_mode) as fh:  # after the checkpoint: a logged epoch is saved
                    fh.write(json.dumps(record) + "\n")
                metrics_mode = "a"
            if self._patience_spent():
                stopped_early = True
                log.info("early stopping: no validation improvement for %d epochs (best %.5f at epoch %d)",
                         self.stale_epochs, self.best_val, self.best_epoch)
            if stop_after_epochs is not None and ran >= stop_after_epochs:
                break
        return TrainResult(self.paths, self.history, self.best_val, ran, stopped_early, self.plan)

    def _patience_spent(self) -> bool:
        """Early stopping: --patience epochs in a row without validation improvement (0: never)."""
        return bool(self.cfg.patience) and self.stale_epochs >= self.cfg.patience

    def _why_finished(self) -> str:
        """Why a resumed run has no epoch left, and the flags that give it more."""
        more = []
        if self._patience_spent():
            more.append(f"a --patience above {self.stale_epochs} (0: never stop early)")
        if self.epoch >= self.cfg.epochs:
            more.append(f"--epochs above {self.epoch}")
        why = (f"the run stopped early at epoch {self.epoch}, after {self.stale_epochs} epochs without validation "
               f"improvement (--patience {self.cfg.patience})" if self._patience_spent()
               else f"the run is at epoch {self.epoch} of --epochs {self.cfg.epochs}")
        return f"{why}; to train on, resume with {' and '.join(more)}"

    def _check_finite(self, train_loss: float, val_loss: float) -> None:
        """Diverged: validation (the weights) went non-finite, or every training step did."""
        if math.isfinite(train_loss) and math.isfinite(val_loss):
            return
        kept = (f"the last good checkpoint is intact: {self.paths.last} (epoch {self.epoch})" if self.epoch
                else "no checkpoint was written")
        clip = (f"set --grad-clip (now {self.cfg.grad_clip:g})" if self.cfg.grad_clip
                else "set --grad-clip (now 0: no clipping; e.g. 1.0)")
        changes = [f"Lower --learning-rate (now {self.cfg.learning_rate:g})", clip]
        if self.precision.name != "fp32":  # half precision overflows first; fp32 already is the widest
            changes.append(f"--precision fp32 (now {self.precision.name})")
        raise TrainingDiverged(
            f"training diverged in epoch {self.epoch + 1}: train loss {train_loss}, validation loss {val_loss}; "
            f"{kept}. {', '.join(changes[:-1])} or {changes[-1]}, and check the bars and user features "
            "for extreme values")

    def _log_epoch(self, r: dict[str, Any]) -> None:
        v, b = r["val"], r["baseline"]
        qs = " ".join(f"q{q}={v['pinball'][q]:.2e}/{b['pinball'][q]:.2e}" for q in v["pinball"])
        rs = format_q_risk(v["q_risk"], b["q_risk"])
        coverage = (f"coverage model {100 * v['coverage']:.1f}% baseline {100 * b['coverage']:.1f}% (nominal "
                    f"{100 * v['nominal_coverage']:.0f}%)" if len(self.cfg.quantiles) > 1
                    else "coverage n/a (one quantile: no interval)")
        log.info(
            "epoch %d/%d  train loss %.4f  val loss %.4f%s  %.0f win/s\n"
            "    pinball model/baseline: %s\n    q-risk  model/baseline: %s\n"
            "    %s  peak memory train %.0f MiB val %.0f MiB (%s)",
            r["epoch"], self.cfg.epochs, r["train_loss"], r["val_loss"], "  *best*" if r["best"] else "",
            r["windows_per_second"], qs, rs, coverage, r["peak_memory"]["train"]["bytes"] / 2**20,
            r["peak_memory"]["val"]["bytes"] / 2**20, r["peak_memory"]["train"]["kind"])
