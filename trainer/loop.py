"""The training loop: AdamW, warm-up + cosine schedule, clipping, early stopping, exact resume. Device,
precision and the memory plan are decided once before the first step."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from features import package_version
from features.bars import ColumnMap
from features.config import FeatureConfig
from features.metrics import climatology_forecast, forecast_metrics, format_q_risk, pinball
from features.schema import MODEL_OUTPUTS, QUANTILES, TARGET
from features.series import roll_lines
from trainer.checkpoint import FORMAT, save_atomic, state_digest
from trainer.config import ConfigError, TrainConfig
from trainer.data import Normalization, PreparedData, ReadBars, prepare, row_inputs
from trainer.device import PeakMemory, autocast_factory, resolve_device, resolve_precision
from trainer.distributed import DistContext, init_from_env
from trainer.loss import pinball_loss
from trainer.modeling import SCALE_LR_FACTOR, RowsForward, TemporalFusionTransformer, TFTOutput
from trainer.paths import RunPaths
from trainer.plan import TrainPlan, literal_plan
from trainer.resume import ResumeState
from trainer.run_files import adopt_best, prepare_out, remove_judgments

log = logging.getLogger("trainer")

PlanFn = Callable[[TemporalFusionTransformer, PreparedData, torch.device, str], TrainPlan]

VALIDATION_SAMPLE_WINDOWS = 256


@dataclass
class TrainResult:
    paths: RunPaths
    history: list[dict[str, Any]]
    epochs_run: int
    stopped_early: bool
    plan: TrainPlan


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


def parameter_groups(model: TemporalFusionTransformer, cfg: TrainConfig) -> list[dict[str, Any]]:
    """The network's parameters; then, for a seasonal scale, its scalars at SCALE_LR_FACTOR times the learning
    rate and without weight decay (which would pull each logit toward 0.5)."""
    scale = model.scale_parameters()
    network = [p for p in model.parameters() if all(p is not q for q in scale)]
    return [{"params": network},
            *([{"params": scale, "lr": cfg.learning_rate * SCALE_LR_FACTOR, "weight_decay": 0.0}] if scale else [])]


class TrainingDiverged(ValueError):
    """The loss became NaN or infinite: nothing of that epoch is saved; the message says what to change."""


def build_model(cfg: TrainConfig, data: PreparedData, device: torch.device) -> TemporalFusionTransformer:
    """The TFT for these data, its normalisation folded in, on `device`."""
    frame, n = data.frame, data.normalization
    model = TemporalFusionTransformer(cfg.model_config(len(frame.schema.observed), len(frame.schema.known),
                                                       len(frame.symbols), frame.config))
    model.set_normalization(n.observed.mean, n.observed.std, n.known.mean, n.known.std, n.target_scale,
                            *((n.static.mean, n.static.std) if n.static is not None else ()))
    if model.cfg.seasonal_scale and data.profile is not None:
        p = data.profile
        model.set_profile(p.coefficients, p.bounds, p.level, p.ranged)
    return model.to(device)


def wrap_ddp(net: torch.nn.Module, dist: DistContext, device: torch.device) -> torch.nn.Module:
    """`net` under DDP when torchrun started the run. Buffers never change, so they are not broadcast (a forward
    holds no collective and can be retried); gradients are views into DDP's buckets, not a second copy."""
    if not dist.enabled:
        return net
    return DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None,
                                   broadcast_buffers=False, gradient_as_bucket_view=True)


def steps_per_epoch(cfg: TrainConfig, train_windows: int, world_size: int) -> int:
    """Optimizer steps of an epoch; a last step too small to give each rank a window is dropped."""
    if cfg.batch_size < world_size:
        raise ConfigError(f"--batch-size {cfg.batch_size} is smaller than the {world_size} processes torchrun "
                          f"started: each needs a window of every step; raise it to at least {world_size}")
    full = train_windows // cfg.batch_size + (train_windows % cfg.batch_size >= world_size)
    return min(full, cfg.max_steps_per_epoch) if cfg.max_steps_per_epoch else full


def schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps: int,
             warn: bool) -> torch.optim.lr_scheduler.LambdaLR:
    if cfg.warmup_steps >= steps and warn:
        log.warning("warmup_steps %d >= the run's %d optimizer steps: the learning rate never reaches its peak (%g) "
                    "nor decays; lower --warmup-steps", cfg.warmup_steps, steps, cfg.learning_rate)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_factory(cfg.warmup_steps, steps))


class Trainer:
    """One training run; `run()` trains until the epochs end or validation stops improving."""

    def __init__(self, source: str | Path | ReadBars, cfg: TrainConfig, out: Path, columns: ColumnMap | None = None,
                 resume: Path | ResumeState | None = None, progress: bool = True, plan_fn: PlanFn | None = None
                 ) -> None:
        self.paths = prepare_out(out, Path(str(source)))
        self.resumed = ResumeState.load(resume) if isinstance(resume, Path) else resume
        if self.resumed is not None:
            cfg = self.resumed.config(cfg)
            # the stored names, unless the caller laid its flags over them
            columns = columns or ColumnMap.from_dict(self.resumed.ckpt["column_map"])
        self.cfg, self.columns, self.source, self.parquet = cfg, columns or ColumnMap(), source, str(source)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.dist = init_from_env(cfg.device)
        self.progress = progress and self.dist.is_main
        self.device = resolve_device(self.dist.device_spec(cfg.device))
        self.precision = resolve_precision(cfg.precision, self.device)
        self.data = self._prepare()
        self.model = build_model(cfg, self.data, self.device)
        self.rows_model = RowsForward(self.model)  # training and validation run the shared-bar forward
        self.net = wrap_ddp(self.rows_model, self.dist, self.device)
        self.plan = (plan_fn(self.model, self.data, self.device, self.precision) if plan_fn
                     else literal_plan(cfg.batch_size, cfg.grad_checkpointing, self.precision))
        self.model.gradient_checkpointing = self.plan.grad_checkpointing
        self.quantiles = torch.tensor(cfg.quantiles, dtype=torch.float32, device=self.device)
        self.target_scale = torch.from_numpy(self.data.normalization.target_scale).to(self.device)
        self.autocast = autocast_factory(self.device, self.precision)
        self.optimizer = torch.optim.AdamW(parameter_groups(self.model, cfg), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay, fused=True)
        self.steps_per_epoch = steps_per_epoch(cfg, self.data.train_anchors.size, self.dist.world_size)
        self.schedule_steps, self.schedule_epochs = (self.resumed.schedule(cfg, self.dist.is_main) if self.resumed
                                                     else (cfg.epochs * self.steps_per_epoch, cfg.epochs))
        self.scheduler = schedule(self.optimizer, cfg, self.schedule_steps, self.dist.is_main and not self.resumed)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.memory = PeakMemory(self.device)
        self.epoch, self.step = 0, 0
        self.history: list[dict[str, Any]] = []
        self.best_val, self.best_epoch, self.stale_epochs = math.inf, 0, 0
        self._exchanging = self._exchange_armed = False  # see _accumulate
        if self.resumed is not None:
            self._restore(self.resumed)

    def _prepare(self) -> PreparedData:
        """The bars as tensors, with the resumed run's (or rank 0's) vocabularies and normalisation; rolls logged."""
        cfg = self.cfg

        def fitted() -> tuple[list[str], dict[str, Any], dict[str, Any]]:
            first = prepare(self.source, cfg, self.columns)
            return first.frame.symbols, first.normalization.to_dict(), first.frame.config.to_dict()

        if self.resumed is not None:
            data = prepare(self.source, cfg, self.columns, *self.resumed.vocabulary())
            self.resumed.check_data(data, cfg.test_fraction)
        elif not self.dist.enabled:
            data = prepare(self.source, cfg, self.columns)
        else:
            symbols, norm, features = self.dist.from_main(fitted)
            data = prepare(self.source, cfg, self.columns, symbols, Normalization.from_dict(norm),
                           FeatureConfig.from_dict(features))
        for line in roll_lines(data.frame.config.contracts, data.rolls, list(data.frame.symbols)):
            log.info("%s", line)
        return data

    def _restore(self, resumed: ResumeState) -> None:
        resumed.restore(self.model, self.optimizer, self.scheduler, self.scaler, self.device)
        ckpt = resumed.ckpt
        self.epoch, self.step = int(ckpt["epoch"]), int(ckpt["step"])
        self.history = list(ckpt["metrics_history"])
        self.best_val, self.best_epoch = float(ckpt["best_val_loss"]), int(ckpt["best_epoch"])
        self.stale_epochs = int(ckpt["epochs_without_improvement"])
        log.info("resumed from epoch %d, step %d (best validation loss %.5f at epoch %d)", self.epoch, self.step,
                 self.best_val, self.best_epoch)

    def _epoch_anchors(self) -> torch.Tensor:
        """Anchors shuffled in blocks of `block_windows` (bars selected once), by (seed, epoch): resume is exact."""
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + self.epoch)
        anchors = torch.from_numpy(self.data.train_anchors)
        n, k = anchors.numel(), self.cfg.block_windows
        starts = torch.arange(0, n, k)[torch.randperm(math.ceil(n / k), generator=g)]  # [n_blocks]
        order = (starts[:, None] + torch.arange(k)).flatten()  # [n_blocks * k]
        order = order[order < n]  # the last block may be short
        return anchors[order][: self.steps_per_epoch * self.cfg.batch_size]

    def _forward(self, batch: dict[str, torch.Tensor], net: torch.nn.Module | None = None) -> TFTOutput:
        with self.autocast():
            return (net or self.rows_model)(*row_inputs(batch))

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=self.device.type == "cuda") for k, v in batch.items()}

    def micro_step(self, anchors: torch.Tensor, weight: float) -> float:
        """Forward and backward of one micro-batch; returns its (unweighted) loss."""
        batch = self._to_device(self.data.tensors.row_batch(anchors))
        out = self._forward(batch, self.net)
        self._exchange_armed = self._exchanging  # DDP's forward readied its gradient exchange, outside no_sync
        loss = normalized_loss(out, batch[TARGET], self.quantiles, self.target_scale)
        self.scaler.scale(loss * weight).backward()
        return float(loss.detach())

    def _zero_grad(self) -> None:
        """Gradients freed (one process) or zeroed in place (DDP: they are views into its buckets, which stay)."""
        self.optimizer.zero_grad(set_to_none=not self.dist.enabled)

    def _optimizer_step(self, anchors: torch.Tensor, step_windows: int) -> float:
        """One optimizer step over this rank's `anchors` in micro-batches, the micro-batch halved on OOM."""
        while True:
            try:
                loss = self._accumulate(anchors, step_windows)
                break
            except torch.OutOfMemoryError as exc:
                self._after_out_of_memory(exc)
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._zero_grad()
        self.scheduler.step()
        self.step += 1
        return loss

    def _accumulate(self, anchors: torch.Tensor, step_windows: int) -> float:
        """Gradients of this rank's micro-batches; the mean loss over `anchors`. Under torchrun, gradients are
        exchanged in the rank's last micro-batch; each loss is weighted by its share of the step times the ranks,
        so DDP's mean over ranks is the step's mean over its windows."""
        scale = self.dist.world_size / step_windows
        chunks = anchors.split(self.plan.micro_batch)
        total = 0.0
        for i, chunk in enumerate(chunks):
            self._exchanging = self.dist.enabled and i == len(chunks) - 1
            self._exchange_armed = False
            with self.net.no_sync() if isinstance(self.net, DistributedDataParallel) and not self._exchanging \
                    else contextlib.nullcontext():
                total += self.micro_step(chunk, chunk.numel() * scale) * chunk.numel() / anchors.numel()
        return total

    def _after_out_of_memory(self, exc: torch.OutOfMemoryError) -> None:
        """Frees the gradients, halves the micro-batch; re-raises at 1 window, or when ranks may be exchanging them."""
        self._zero_grad()
        torch.cuda.empty_cache()  # a no-op where CUDA is not in use
        if self._exchanging and self._exchange_armed:
            raise torch.OutOfMemoryError(
                f"{str(exc).splitlines()[0]} (in the micro-batch whose backward exchanges gradients between "
                f"the {self.dist.world_size} ranks, which cannot be retried at a smaller size)") from exc
        if self.plan.micro_batch <= 1:
            raise exc
        self.plan = self.plan.halved()
        log.warning("out of memory: micro-batch halved to %d, accumulation %d steps (effective batch %d kept)",
                    self.plan.micro_batch, self.plan.accumulation, self.plan.batch_size)

    def train_epoch(self) -> dict[str, float]:
        self.model.train()
        anchors = self._epoch_anchors()
        losses: list[float] = []
        shares: list[float] = []  # this rank's windows over the step's, times the ranks (1 in one process)
        t0 = time.perf_counter()
        if self.dist.rank:  # dropout masks of their own on the other ranks; (seed, rank, epoch) keeps resume exact
            torch.manual_seed((self.cfg.seed * 1_000_003 + self.dist.rank) * 1_009 + self.epoch)
        # disable=None: no bar where stderr is not a terminal
        with tqdm(total=anchors.numel(), unit="win", unit_scale=True, disable=None if self.progress else True,
                  leave=False, desc=f"epoch {self.epoch + 1}/{self.cfg.epochs}", dynamic_ncols=True) as bar:
            for step_anchors in anchors.split(self.cfg.batch_size):  # each gives every rank a window (steps_per_epoch)
                mine = self.dist.shard(step_anchors)
                losses.append(self._optimizer_step(mine, step_anchors.numel()))
                shares.append(mine.numel() * self.dist.world_size / step_anchors.numel())
                bar.update(step_anchors.numel())
                bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{self.scheduler.get_last_lr()[0]:.2e}")
        seconds = time.perf_counter() - t0
        # fp16's gradient scaler skips a step whose loss overflowed: counted, and left out of the epoch's loss
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
        """The model's `outputs` on `anchors` in eval mode; only those are kept."""
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
                torch.cuda.empty_cache()
                if size <= 1:
                    raise
                size = max(1, size // 2)
                log.warning("out of memory in validation: validation batch halved to %d", size)

    def validate(self) -> dict[str, Any]:
        return self.evaluate(self.data.val_anchors, "val")

    def evaluate(self, anchors: np.ndarray, split: str) -> dict[str, Any]:
        """Loss and forecast metrics beside climatology's: `{split}_loss`, `{split}`, `baseline`, `{split}_windows`."""
        pred = self.predict(anchors, outputs=(QUANTILES,))[QUANTILES]  # [W, H, Q]
        target = self.data.frame.targets[anchors]  # [W, H]
        scale = self.data.normalization.target_scale
        q = tuple(self.cfg.quantiles)
        loss = float((pinball(pred / scale[None, :, None], target / scale[None, :], np.asarray(q))).mean())
        base = climatology_forecast(self.data.climatology, anchors.size)
        return {f"{split}_loss": loss, split: forecast_metrics(pred, target, q),
                "baseline": forecast_metrics(base, target, q), f"{split}_windows": int(anchors.size)}

    def state(self) -> dict[str, Any]:
        frame = self.data.frame
        sample = self.data.tensors.batch(torch.from_numpy(self.data.val_anchors[:VALIDATION_SAMPLE_WINDOWS]))
        return {
            "format": FORMAT, "version": package_version(), "torch_version": str(torch.__version__),
            "model_config": self.model.cfg.to_dict(), "train_config": self.cfg.to_dict(),
            "feature_config": frame.config.to_dict(), "feature_schema": frame.schema.to_list(),
            "normalization": self.data.normalization.to_dict(), "symbols": list(frame.symbols),
            "bar_interval_ns": int(frame.bar_interval_ns), "column_map": self.columns.to_dict(),
            "data_source": self.parquet, "split_times_ns": list(self.data.split_times_ns),
            "data_span_ns": [int(frame.timestamp_ns.min()), int(frame.timestamp_ns.max())],  # the bars trained on
            "bars_digest": self.data.bars_digest,  # what a resume must read again
            "dropped_rows": [d.to_dict() for d in self.data.dropped],  # by --bad-rows drop
            **({"rolls": [r.to_dict() for r in self.data.rolls]} if frame.config.contracts is not None else {}),
            "climatology": torch.from_numpy(self.data.climatology.copy()),
            "model_state": (weights := {k: v.detach().cpu() for k, v in self.model.state_dict().items()}),
            "model_state_sha256": state_digest(weights),
            "optimizer_state": self.optimizer.state_dict(), "scheduler_state": self.scheduler.state_dict(),
            "schedule_steps": self.schedule_steps,  # the schedule's length, kept by a resume with other --epochs
            "schedule_epochs": self.schedule_epochs, "scaler_state": self.scaler.state_dict(),
            "epoch": self.epoch, "step": self.step,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else []},
            "metrics_history": self.history, "peak_memory": [h["peak_memory"] for h in self.history],
            "best_val_loss": self.best_val, "best_epoch": self.best_epoch,
            "epochs_without_improvement": self.stale_epochs, "plan": self.plan.to_dict(),
            "validation_sample": {k: v.clone() for k, v in sample.items()},
        }

    def run(self, stop_after_epochs: int | None = None,
            on_epoch: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
        """Train; `stop_after_epochs` ends this process's part early (as an interruption would). On rank 0,
        `on_epoch` takes each epoch's record once its checkpoints and metrics line are written."""
        self._start()
        stopped_early = self._patience_spent()
        ran = 0
        while self.epoch < self.cfg.epochs and not stopped_early:
            record = self._train_and_validate()
            ran += 1
            if self.dist.is_main:
                self._save(record)
                if on_epoch is not None:
                    on_epoch(record)
            if self._patience_spent():
                stopped_early = True
                log.info("early stopping: no validation improvement for %d epochs (best %.5f at epoch %d)",
                         self.stale_epochs, self.best_val, self.best_epoch)
            if stop_after_epochs is not None and ran >= stop_after_epochs:
                break
        return TrainResult(self.paths, self.history, ran, stopped_early, self.plan)

    def _start(self) -> None:
        """Logs the plan; on rank 0, says when nothing is left to train and rewrites a resumed run's metrics file."""
        log.info("plan: micro-batch %d x %d accumulation = batch %d, gradient checkpointing %s, %s",
                 self.plan.micro_batch, self.plan.accumulation, self.plan.batch_size,
                 "on" if self.plan.grad_checkpointing else "off", self.plan.precision)
        if not self.dist.is_main:
            return
        if self._patience_spent() or self.epoch >= self.cfg.epochs:
            log.warning("nothing to train: %s", self._why_finished())
        if self.resumed is not None:
            self._warn_if_behind_last(self.resumed.path)
            adopt_best(self.paths, self.resumed.path, self.best_epoch, self.best_val, self.history)
            self.paths.metrics.parent.mkdir(parents=True, exist_ok=True)
            self.paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        elif old := [p for p in (self.paths.best, self.paths.last) if p.exists()]:
            log.warning("%s: from an earlier run; this run replaces them as its epochs finish",
                        ", ".join(str(p) for p in old))

    def _warn_if_behind_last(self, resumed: Path) -> None:
        """Resuming the best checkpoint while --out's latest is further along replaces the later epochs."""
        last = self.paths.last
        if not last.is_file() or last.resolve() == resumed.resolve():
            return
        try:
            later = int(torch.load(last, map_location="cpu", weights_only=True, mmap=True)["epoch"])
        except Exception:  # not a checkpoint of ours: nothing to compare with
            return
        if later > self.epoch:
            log.warning("resuming from epoch %d, but %s is at epoch %d and this run replaces it; resume from %s "
                        "to keep those epochs", self.epoch, last, later, last)

    def _train_and_validate(self) -> dict[str, Any]:
        """One epoch and its validation, its record; rank 0 validates, all ranks take its figures: all decide alike."""
        self.memory.start()
        train_stats = self.train_epoch()
        train_peak = self.memory.read()
        self.memory.start()
        val_stats = self.dist.from_main(self.validate)
        val_peak = self.memory.read()
        self._check_finite(train_stats["train_loss"], val_stats["val_loss"])
        self.epoch += 1
        improved = val_stats["val_loss"] < self.best_val
        if improved:
            self.best_val, self.best_epoch, self.stale_epochs = val_stats["val_loss"], self.epoch, 0
        else:
            self.stale_epochs += 1
        record = {"epoch": self.epoch, "step": self.step, "lr": self.scheduler.get_last_lr()[0], **train_stats,
                  **val_stats, "micro_batch": self.plan.micro_batch,
                  "peak_memory": {"train": train_peak, "val": val_peak}, "best": improved}
        self.history.append(record)
        return record

    def _save(self, record: dict[str, Any]) -> None:
        """The epoch's checkpoints, then its metrics line; a fresh run's best removes older report and test scores."""
        self._log_epoch(record)
        state = self.state()
        save_atomic(state, self.paths.last)
        if record["best"]:
            save_atomic(state, self.paths.best)
            if self.resumed is None:
                remove_judgments(self.paths, "from an earlier run")
        with self.paths.metrics.open("w" if len(self.history) == 1 and self.resumed is None else "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def _patience_spent(self) -> bool:  # early stopping (--patience 0: never)
        return bool(self.cfg.patience) and self.stale_epochs >= self.cfg.patience

    def _why_finished(self) -> str:
        """Why a resumed run has no epoch left, and the flags that give it more."""
        spent = self._patience_spent()
        more = [f"a --patience above {self.stale_epochs} (0: never stop early)"] if spent else []
        if self.epoch >= self.cfg.epochs:
            more.append(f"--epochs above {self.epoch}")
        why = (f"the run stopped early at epoch {self.epoch}, after {self.stale_epochs} epochs without validation "
               f"improvement (--patience {self.cfg.patience})" if spent
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
        if self.precision != "fp32":  # half precision overflows first; fp32 already is the widest
            changes.append(f"--precision fp32 (now {self.precision})")
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
