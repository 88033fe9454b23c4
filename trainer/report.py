"""The report picture beside the checkpoint: what a user looks at after a run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from features.files import atomic_output

FAN_WINDOWS = 300


def write_panels(path: Path, panels: Sequence[Callable[..., None]], *args: Any) -> None:
    """A PNG of four panels, 2 x 2 in reading order, each drawn by `panel(ax, *args)`."""
    from matplotlib.figure import Figure  # imported here: a command's start (and --help) need no plotting library

    fig = Figure(figsize=(14, 9))  # no pyplot: nothing global, no GUI backend, nothing to close
    for ax, panel in zip(fig.subplots(2, 2).flat, panels, strict=True):
        panel(ax, *args)
    fig.tight_layout()
    with atomic_output(path) as tmp:  # whole or not at all, Ctrl-C included
        fig.savefig(tmp, dpi=90, format="png")


def write_report(path: Path, history: list[dict[str, Any]], outputs: dict[str, np.ndarray], target: np.ndarray,
                 quantiles: tuple[float, ...], observed_names: list[str], known_names: list[str],
                 static_names: list[str]) -> None:
    """Loss curves, a fan chart against realised returns (horizon 1), variable importances and mean
    attention, from the model's `outputs` on consecutive validation windows and their `target` [W, H]."""
    write_panels(path, [lambda ax: _loss_curves(ax, history),
                        lambda ax: _fan_chart(ax, outputs["quantiles"], target, quantiles),
                        lambda ax: _importances(ax, outputs, observed_names, known_names, static_names),
                        lambda ax: _attention(ax, outputs["attention"], target.shape[1])])


def _loss_curves(ax: Any, history: list[dict[str, Any]]) -> None:
    ep = [h["epoch"] for h in history]
    ax.plot(ep, [h["train_loss"] for h in history], "o-", label="train")
    ax.plot(ep, [h["val_loss"] for h in history], "o-", label="validation")
    base = [h["baseline"]["pinball_mean"] / h["val"]["pinball_mean"] * h["val_loss"] for h in history]
    ax.plot(ep, base, "--", color="grey", label="climatology baseline (validation)")
    ax.set(title="pinball loss (units of target std)", xlabel="epoch")
    ax.legend()


def _fan_chart(ax: Any, q: np.ndarray, target: np.ndarray, quantiles: tuple[float, ...]) -> None:
    n = min(FAN_WINDOWS, q.shape[0])
    x = np.arange(n)
    if len(quantiles) > 1:
        ax.fill_between(x, q[:n, 0, 0], q[:n, 0, -1], alpha=0.3,
                        label=f"P{quantiles[0] * 100:g}-P{quantiles[-1] * 100:g}")
    inner = range(1, len(quantiles) - 1) if len(quantiles) > 1 else range(1)  # the band's edges are not its centre
    if inner:
        mid = min(inner, key=lambda i: abs(quantiles[i] - 0.5))  # the median, or the level nearest it
        ax.plot(x, q[:n, 0, mid], lw=1, label=f"P{quantiles[mid] * 100:g}")
    ax.plot(x, target[:n, 0], ".", ms=3, color="black", label="realised")
    ax.set(title="validation: 1-step log return, forecast fan vs realised", xlabel="window")
    ax.legend(loc="upper right")


def _importances(ax: Any, outputs: dict[str, np.ndarray], observed: list[str], known: list[str],
                 static: list[str]) -> None:
    enc = outputs["encoder_weights"].mean(axis=(0, 1))  # [n_observed + n_known]
    dec = outputs["decoder_weights"].mean(axis=(0, 1))  # [n_known]
    names = [f"enc:{n}" for n in (*observed, *known)] + [f"dec:{n}" for n in known]
    values = np.concatenate([enc, dec])
    order = np.argsort(values)[-20:]
    ax.barh([names[i] for i in order], values[order])
    st = outputs["static_weights"].mean(axis=0)
    ax.set(title="variable importance (mean selection weight); static: "
           + ", ".join(f"{n}={w:.2f}" for n, w in zip(static, st, strict=False)))


def _attention(ax: Any, attention: np.ndarray, horizon: int) -> None:
    att = attention.mean(axis=(0, 1))  # [L + H]
    enc = att[: att.shape[0] - horizon]
    ax.plot(np.arange(-enc.shape[0] + 1, 1), enc)
    ax.set(title="mean attention over encoder positions", xlabel="bars before the forecast origin",
           ylabel="attention weight")
