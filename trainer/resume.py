"""What a resumed run takes from its checkpoint: recipe, vocabulary, schedule and state."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from features.config import FeatureConfig
from trainer.checkpoint import load_checkpoint
from trainer.config import RESUME_OVERRIDABLE, STOPPING_RULES, TrainConfig, resumed_config
from trainer.data import Normalization, PreparedData, check_resumed_bars, check_resumed_split

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class ResumeState:
    path: Path  # the checkpoint resumed from
    ckpt: dict[str, Any]  # as load_checkpoint returns it

    @staticmethod
    def load(path: Path) -> ResumeState:
        return ResumeState(path, load_checkpoint(path))

    def config(self, cfg: TrainConfig) -> TrainConfig:
        """The run's recipe from the checkpoint; the machine it runs on and its stopping rules from `cfg`."""
        stored = TrainConfig.from_dict(self.ckpt["train_config"])
        for rule in STOPPING_RULES:
            if getattr(cfg, rule) != getattr(stored, rule):
                log.info("resume: %s %d -> %d", rule, getattr(stored, rule), getattr(cfg, rule))
        return resumed_config(stored, cfg, set(RESUME_OVERRIDABLE))

    def vocabulary(self) -> tuple[list[str], Normalization, FeatureConfig]:
        """The symbols, normalisation and feature config (with vocabularies) the run fitted, which a resume keeps."""
        return (list(self.ckpt["symbols"]), Normalization.from_dict(self.ckpt["normalization"]),
                FeatureConfig.from_dict(self.ckpt["feature_config"]))

    def check_data(self, data: PreparedData, test_fraction: float) -> None:
        """DataError unless these bars are the ones the run read, split where it split them."""
        source = str(self.ckpt["data_source"])
        check_resumed_split(self.ckpt["split_times_ns"], data.split_times_ns, test_fraction, source)
        check_resumed_bars(self.ckpt["bars_digest"], data.bars_digest, source)

    def schedule(self, cfg: TrainConfig, warn: bool) -> tuple[int, int]:
        """The resumed run's schedule length (steps, epochs), whatever --epochs says now: past it, the floor."""
        steps, epochs = int(self.ckpt["schedule_steps"]), int(self.ckpt["schedule_epochs"])
        if cfg.epochs > epochs and warn:
            log.warning("--epochs %d goes past the resumed run's learning-rate schedule (%d epochs, %d optimizer "
                        "steps): the schedule is kept, so the steps after it train at its floor, %.3g (10%% of the "
                        "peak); for a longer cosine, start a new run with --epochs %d", cfg.epochs, epochs, steps,
                        0.1 * cfg.learning_rate, cfg.epochs)
        return steps, epochs

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                device: torch.device) -> None:
        """Weights, optimizer, schedule, gradient scaler and random state as the checkpoint holds them."""
        ckpt = self.ckpt
        model.load_state_dict(ckpt["model_state"])
        optimizer.load_state_dict(ckpt["optimizer_state"])
        scheduler.load_state_dict(ckpt["scheduler_state"])
        scaler.load_state_dict(ckpt["scaler_state"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(list(ckpt["rng"]["cuda"]))
