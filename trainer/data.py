"""Training data: features computed once into contiguous tensors, windows taken by index.

The split is chronological on one time axis shared by all symbols, with a purge of H bars after
each boundary so no target of one split overlaps the next. Normalisation fits the training rows.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from features.bars import Bars, ColumnMap, DroppedRow, bars_digest
from features.calendar import (
    COARSE_INTERVALS,
    HOUR_NS,
    NS_PER_DAY,
    DayOffsets,
    infer_bar_interval_ns,
    local_ns,
    profile_slots,
)
from features.check import format_timestamp
from features.compute import FeatureFrame, build_frame, with_trading_hours, with_vocabularies
from features.config import FeatureConfig
from features.contracts import ContractConfig
from features.exchanges import EXCHANGE_ZONE, exchange_zone
from features.normalize import MIN_STD, NormStats, spread_of
from features.rolls import Roll, contract_roots
from features.schema import (
    DECODER_KNOWN,
    ENCODER_KNOWN,
    ENCODER_OBSERVED,
    STATIC_CATEGORICAL,
    STATIC_REAL,
    TARGET,
    Role,
)
from features.series import ContractError, as_series, read_contract_bars, scan_contracts
from features.windows import anchor_rows, decoder_known, static_categorical
from trainer.config import TrainConfig
from trainer.modeling import LOG_RANGE, LOG_RETURN, N_PROFILE_TERMS, N_TOD_TERMS, profile_terms

ROW_OBSERVED = "row_observed"  # float32 [R, n_obs]  observed features of each distinct bar of a batch
ROW_KNOWN = "row_known"  # float32 [R, n_known]
ROW_WINDOW = "row_window"  # int64 [R]  a window holding each bar
WINDOW_ROWS = "window_rows"  # int64 [B, L]  each window's encoder bars, as indices into the rows
ROW_INPUTS = (STATIC_CATEGORICAL, ROW_OBSERVED, ROW_KNOWN, ROW_WINDOW, WINDOW_ROWS, DECODER_KNOWN)  # forward_rows


def row_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """forward_rows' arguments from a row batch: ROW_INPUTS, then STATIC_REAL when the model has static reals."""
    return (*(batch[name] for name in ROW_INPUTS), *((batch[STATIC_REAL],) if STATIC_REAL in batch else ()))


class DataError(ValueError):
    """Data that cannot be trained on (too few bars, an empty split); the message says why."""


@dataclass
class Normalization:
    observed: NormStats  # categorical columns: mean 0, std 1 (the model reads their ids raw)
    known: NormStats  # likewise
    target_scale: np.ndarray  # float32 [H]  std of each horizon's target on the training windows
    static: NormStats | None = None  # of the user static reals; None when the model has none

    def to_dict(self) -> dict[str, object]:
        d = {"observed": self.observed.to_dict(), "known": self.known.to_dict(),
             "target_scale": self.target_scale.astype(float).tolist()}
        return d | ({"static": self.static.to_dict()} if self.static is not None else {})

    @staticmethod
    def from_dict(d: dict[str, object]) -> Normalization:
        obs, kn, st = d["observed"], d["known"], d.get("static")
        assert isinstance(obs, dict) and isinstance(kn, dict)
        return Normalization(NormStats.from_dict(obs), NormStats.from_dict(kn),
                             np.asarray(d["target_scale"], dtype=np.float32),
                             NormStats.from_dict(st) if isinstance(st, dict) else None)


class WindowTensors:
    """Contiguous tensors of every row, and batch assembly by index (no per-sample Python)."""

    def __init__(self, frame: FeatureFrame, encoder_length: int) -> None:
        self.encoder_length = encoder_length
        self.observed = torch.from_numpy(frame.observed)  # [N, n_obs]  NaN in warm-ups: zeroed per batch
        self.known = torch.from_numpy(frame.known)  # [N, n_known]
        self.static_categorical = torch.from_numpy(  # [N, n_static_cat]  symbol id, then user static ids
            frame.series_id[:, None] if frame.static_ids is None else static_categorical(frame, np.arange(len(frame))))
        self.static_real = None if frame.static_real is None else torch.from_numpy(frame.static_real)  # [N, n_sr]
        self._frame = frame
        self.targets = torch.from_numpy(np.nan_to_num(frame.targets, nan=0.0))  # [N, H]
        self.offsets = torch.arange(-encoder_length + 1, 1)  # [L]
        self._offsets: DayOffsets | None = None  # the calendar zone's offsets over the bars' span and horizon
        if frame.config.calendar_tz != "UTC" and frame.timestamp_ns.size:  # trading hours skip a week at most
            last = int(frame.timestamp_ns.max()) + frame.config.horizon * frame.bar_interval_ns + 8 * NS_PER_DAY
            self._offsets = DayOffsets.span(frame.config.calendar_tz, int(frame.timestamp_ns.min()) // NS_PER_DAY,
                                            last // NS_PER_DAY)

    def future_known(self, anchors: torch.Tensor) -> torch.Tensor:
        """The decoder's known features of the windows ending at `anchors`: [B, H, n_known]
        (features.windows.decoder_known), computed per batch: stored, they would take H times the memory."""
        return torch.from_numpy(decoder_known(self._frame, anchors.numpy(), self._offsets))

    def statics(self, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        """The static inputs of the windows ending at `anchors`: STATIC_CATEGORICAL, and STATIC_REAL if any."""
        out = {STATIC_CATEGORICAL: self.static_categorical[anchors]}  # [B, n_static_cat]
        if self.static_real is not None:
            out[STATIC_REAL] = self.static_real[anchors]  # [B, n_static_real]
        return out

    def batch(self, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = anchors[:, None] + self.offsets  # [B, L]
        return {
            **self.statics(anchors),  # [B, n_static_cat] (and [B, n_static_real])
            ENCODER_OBSERVED: torch.nan_to_num(self.observed[idx], nan=0.0),  # [B, L, n_obs]
            ENCODER_KNOWN: self.known[idx],  # [B, L, n_known]
            DECODER_KNOWN: self.future_known(anchors),  # [B, H, n_known]
            TARGET: self.targets[anchors],  # [B, H]
        }

    def row_batch(self, anchors: torch.Tensor, share_bars: bool = True) -> dict[str, torch.Tensor]:
        """The windows ending at `anchors` as distinct bar rows plus indices (the model's forward_rows); each
        row takes the static context of the first window holding it. `share_bars=False`: rows of its own per
        window, the most memory a batch can take (what the VRAM planner measures)."""
        if not share_bars:
            return unshared_rows(self.batch(anchors))
        idx = anchors[:, None] + self.offsets  # [B, L]
        rows, inverse = torch.unique(idx, sorted=True, return_inverse=True)  # [R], [B, L]
        window_of = torch.arange(anchors.numel()).repeat_interleave(self.encoder_length)  # [B*L]
        first = torch.full((rows.numel(),), anchors.numel(), dtype=torch.int64)
        return {
            **self.statics(anchors),  # [B, n_static_cat] (and [B, n_static_real])
            ROW_OBSERVED: torch.nan_to_num(self.observed[rows], nan=0.0),  # [R, n_obs]
            ROW_KNOWN: self.known[rows],  # [R, n_known]
            ROW_WINDOW: first.scatter_reduce_(0, inverse.flatten(), window_of, reduce="amin"),  # [R]
            WINDOW_ROWS: inverse,  # [B, L]
            DECODER_KNOWN: self.future_known(anchors),  # [B, H, n_known]
            TARGET: self.targets[anchors],  # [B, H]
        }


def unshared_rows(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A per-window batch (MODEL_INPUTS, TARGET) in forward_rows' form, every window with rows of its own."""
    observed = batch[ENCODER_OBSERVED]  # [B, L, n_obs]
    b, length = observed.shape[:2]
    return {
        STATIC_CATEGORICAL: batch[STATIC_CATEGORICAL],  # [B, n_static]
        ROW_OBSERVED: observed.reshape(b * length, -1),  # [B*L, n_obs]
        ROW_KNOWN: batch[ENCODER_KNOWN].reshape(b * length, -1),  # [B*L, n_known]
        ROW_WINDOW: torch.arange(b).repeat_interleave(length),  # [B*L]
        WINDOW_ROWS: torch.arange(b * length).view(b, length),  # [B, L]
        DECODER_KNOWN: batch[DECODER_KNOWN],  # [B, H, n_known]
        **{name: batch[name] for name in (STATIC_REAL, TARGET) if name in batch},  # [B, n_static_real], [B, H]
    }


log = logging.getLogger("trainer")

PROFILE_MIN_RETURNS = 20  # returns a slot needs to enter the profile's fit
PROFILE_SLOTS_PER_TERM = 2  # slots the fit needs per coefficient; fewer: a flat profile
PROFILE_RIDGE = 1e-3  # ridge on the profile's terms (not its constant), per unit of mean slot weight
RANGED_SHARE = 0.9  # bars with a range (high > low) a series needs for its ranges to enter the variance


@dataclass(frozen=True)
class Profile:
    """A calendar log-volatility profile: of one series (fit_profile), or a row per symbol id (training_profile)."""

    coefficients: np.ndarray  # float32 [(S,) 1 + N_PROFILE_TERMS]  constant, then those of modeling.profile_terms
    bounds: np.ndarray  # float32 [(S,) 2]  the least and most log profile over the fitted slots
    level: np.ndarray  # float32 [(S,)]  the RMS 1-bar log return, the variance's long-run level; 0: none
    ranged: np.ndarray  # float32 [(S,)]  1 where RANGED_SHARE of the bars have a range (high > low), else 0

    @staticmethod
    def flat(level: float = 0.0, ranged: float = 0.0) -> Profile:
        """p = 1 at every bar."""
        return Profile(np.zeros(1 + N_PROFILE_TERMS, np.float32), np.zeros(2, np.float32),
                       np.array(level, np.float32), np.array(ranged, np.float32))

    @property
    def is_flat(self) -> bool:
        return not self.coefficients.any()


def training_profile(frame: FeatureFrame, train_rows: np.ndarray) -> Profile:
    """A profile per symbol id, [S, ...]: fit_profile of the 1-bar log returns of the symbol's training rows,
    or of all training rows where the symbol's are too few to fit. Symbols trade different hours (a CME
    livestock future's day session, an equity index's overnight trade), so one pooled profile misleads."""

    def fit(rows: np.ndarray) -> Profile:
        return fit_profile(frame.observed[rows, LOG_RETURN], frame.timestamp_ns[rows], frame.config.calendar_tz,
                           frame.bar_interval_ns, frame.observed[rows, LOG_RANGE])

    pooled = fit(train_rows)
    own = [fit(train_rows[frame.series_id[train_rows] == s]) for s in range(len(frame.symbols))]
    shape = [pooled if p.is_flat else p for p in own]
    if not pooled.is_flat:
        log.info("volatility profile: %d of %d symbols fit their own; the rest take that of all training bars",
                 sum(not p.is_flat for p in own), len(own))
    known = [p if p.level > 0 else pooled for p in own]  # a symbol without training bars: all symbols'
    return Profile(np.stack([p.coefficients for p in shape]), np.stack([p.bounds for p in shape]),
                   np.array([p.level for p in known], np.float32), np.array([p.ranged for p in known], np.float32))


def fit_profile(returns: np.ndarray, timestamp_ns: np.ndarray, calendar_tz: str, bar_interval_ns: int,
                log_ranges: np.ndarray | None = None) -> Profile:
    """The log-volatility profile of bars' 1-bar log `returns` [n] (NaN: none) at `timestamp_ns` [n]: per-slot
    RMS return (hour of week for bars of an hour or more, 15 minutes of the day for finer bars: then the
    day-of-week terms stay 0), its log fitted by weighted least squares on profile_terms, normalised to unit RMS
    over the returns. Daily or coarser bars, or too few slots to fit: flat. Its level: the RMS return, of
    PROFILE_MIN_RETURNS or more; ranged: whether RANGED_SHARE of the bars' `log_ranges` are positive, and vary
    (a range fixed by the feed tells nothing of volatility)."""
    finite = np.asarray(returns, np.float64)[np.isfinite(returns)]
    level = float(np.sqrt(np.mean(finite**2))) if finite.size >= PROFILE_MIN_RETURNS else 0.0
    ranges = np.asarray(log_ranges if log_ranges is not None else [], np.float64)
    ranges = ranges[np.isfinite(ranges)]
    ranged = float(ranges.size > 0 and np.mean(ranges > 0) >= RANGED_SHARE and ranges.std() >= MIN_STD)
    if bar_interval_ns >= NS_PER_DAY:
        return Profile.flat(level, ranged)
    count, log_rms, terms = _slot_stats(returns, timestamp_ns, calendar_tz, bar_interval_ns)  # [S], [S], [S, 1+P]
    if count.size < PROFILE_SLOTS_PER_TERM * terms.shape[1]:
        log.debug("volatility profile: %d calendar slots with %d returns each are too few to fit; flat profile",
                  count.size, PROFILE_MIN_RETURNS)
        return Profile.flat(level, ranged)
    w = count / count.mean()  # [S]
    ridge = PROFILE_RIDGE * np.diag([0.0] + [1.0] * (terms.shape[1] - 1))  # [1+P, 1+P]
    gram = terms.T @ (w[:, None] * terms) + ridge * w.sum()
    beta = np.linalg.solve(gram, terms.T @ (w * log_rms))  # [1+P]
    fitted = terms @ beta  # [S]
    beta[0] -= 0.5 * np.log(np.sum(count * np.exp(2.0 * fitted)) / count.sum())  # unit RMS
    fitted = terms @ beta
    coefficients = np.zeros(1 + N_PROFILE_TERMS)
    coefficients[: beta.size] = beta
    return Profile(coefficients.astype(np.float32), np.array([fitted.min(), fitted.max()], np.float32),
                   np.array(level, np.float32), np.array(ranged, np.float32))


def _slot_stats(returns: np.ndarray, timestamp_ns: np.ndarray, tz: str,
                bar_interval_ns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The finite returns grouped by slot of local time (hour of week, or 15 minutes of the day), the slots with
    PROFILE_MIN_RETURNS or more, not all zero: each slot's count of returns [S], log RMS return [S], and terms
    [S, 1 + P] (1, then profile_terms at the slot's mean bar time: the day's terms alone unless weekly)."""
    r = np.asarray(returns, dtype=np.float64)  # [n]
    ok = np.isfinite(r)
    ts = np.asarray(timestamp_ns, dtype=np.int64)[ok]
    tod = local_ns(ts, tz) % NS_PER_DAY  # [n] ns into the local day
    slot, n_slots = profile_slots(ts, bar_interval_ns, tz)  # [n]
    weekly = bar_interval_ns >= HOUR_NS
    count = np.bincount(slot, minlength=n_slots).astype(np.float64)  # [slots]
    square = np.bincount(slot, r[ok] ** 2, minlength=n_slots)  # [slots]
    keep = (count >= PROFILE_MIN_RETURNS) & (square > 0)  # [slots]
    mean_tod = np.bincount(slot, tod / NS_PER_DAY, minlength=n_slots)[keep] / count[keep]  # [S] fraction of a day
    tod_angle = 2 * np.pi * mean_tod
    dow_angle = 2 * np.pi * (np.flatnonzero(keep) // 24) / 7.0  # [S]
    terms = np.stack(profile_terms(np.sin(tod_angle), np.cos(tod_angle), np.sin(dow_angle), np.cos(dow_angle)),
                     axis=-1)  # [S, P]
    terms = terms if weekly else terms[:, :N_TOD_TERMS]
    return (count[keep], 0.5 * np.log(square[keep] / count[keep]),
            np.concatenate([np.ones((terms.shape[0], 1)), terms], axis=1))


@dataclass
class PreparedData:
    frame: FeatureFrame
    tensors: WindowTensors
    train_anchors: np.ndarray  # int64 [W_train]
    val_anchors: np.ndarray  # int64 [W_val]
    test_anchors: np.ndarray  # int64 [W_test]
    normalization: Normalization
    climatology: np.ndarray  # float32 [H, Q]  train-split target quantiles (the baseline forecast)
    split_times_ns: tuple[int, int]  # first timestamp of validation and of test
    bars_digest: str  # of the series trained on (training_digest): a resume must read the same ones
    rolls: list[Roll] = field(default_factory=list)  # the contract rolls of the series; none for plain series
    profile: Profile | None = None  # the volatility profile of the training rows, for a seasonal scale
    dropped: list[DroppedRow] = field(default_factory=list)  # rows of the files `--bad-rows drop` left out


def split_rows(frame: FeatureFrame, val_fraction: float, test_fraction: float) -> tuple[np.ndarray, ...]:
    """Per-series row boundaries: train [s, b_val), val [b_val + H, b_test), test [b_test + H, e)."""
    cuts = split_times(frame.timestamp_ns, val_fraction, test_fraction)
    b_val, b_test = (np.array([s + np.searchsorted(frame.timestamp_ns[s:e], cut) for s, e in frame.series_bounds])
                     for cut in cuts)
    return frame.series_bounds[:, 0], frame.series_bounds[:, 1], b_val, b_test, np.array(cuts)


def split_times(timestamp_ns: np.ndarray, val_fraction: float, test_fraction: float) -> tuple[int, int]:
    """The first timestamps of validation and test (test: past the last bar when none), as shares of distinct times."""
    ts_sorted = np.unique(timestamp_ns)
    n = ts_sorted.size
    cut_val = ts_sorted[min(n - 1, int(n * (1.0 - val_fraction - test_fraction)))]
    cut_test = ts_sorted[min(n - 1, int(n * (1.0 - test_fraction)))] if test_fraction > 0 else ts_sorted[-1] + 1
    return int(cut_val), int(cut_test)


RESUME_FIX = "resume with the bars the run started with, or start a new run (without --resume) to train on these"


def check_resumed_bars(stored: str, now: str, source: str) -> None:
    """DataError when a resumed run reads other bars than its checkpoint's run did."""
    if stored != now:
        raise DataError(f"--resume: these bars are not the ones the checkpoint's run read (its bars: {source}): they "
                        "split at the same times, but their symbols, rows or values differ. Resuming would compare "
                        f"validation losses over different bars: {RESUME_FIX}")


def check_resumed_split(stored: Sequence[int], now: tuple[int, int], test_fraction: float, source: str) -> None:
    """DataError when a resumed run would split its bars elsewhere than its checkpoint's run did."""
    if tuple(int(t) for t in stored) == now:
        return

    def split(cuts: Sequence[int]) -> str:
        val, test = int(cuts[0]), int(cuts[1])
        last = f" to the last bar at {format_timestamp(test - 1)}"
        end = f", test from {format_timestamp(test)}" if test_fraction > 0 else last
        return f"validation from {format_timestamp(val)}{end}"

    raise DataError(f"--resume: these bars split as {split(now)}; the checkpoint's run split as {split(stored)} "
                    f"(its bars: {source}). Resuming would train on bars that run held out and compare validation "
                    f"losses over different bars: {RESUME_FIX}")


def warn_about_constant_features(frame: FeatureFrame, train_rows: np.ndarray) -> None:
    """Warn about an observed or known real feature that never changes over the training rows: it tells the model
    nothing. Categorical columns are left out (a label the training split never changes is worth no warning here)."""
    schema = frame.schema
    try:
        spread = spread_of(frame.observed, train_rows)[1]  # [n_observed]
        known_spread = spread_of(frame.known, train_rows)[1]  # [n_known]
    except ValueError:  # a column without a value: the normalisation's fit says which
        return
    categorical = {*schema.categorical(Role.OBSERVED), *schema.categorical(Role.KNOWN)}
    user = set(schema.user_columns) - categorical
    flat = [name for name, sd in zip(schema.observed, spread, strict=True) if not sd >= MIN_STD and
            name not in categorical]
    flat_known = [name for name, sd in zip(schema.known, known_spread, strict=True) if not sd >= MIN_STD and
                  name in user]
    for kind, names, flag in (("user", [n for n in flat if n in user], "--features"),
                              ("known", flat_known, "--known-features")):
        if names:
            log.warning("%s feature(s) %s never change over the training bars: the model learns nothing from them; "
                        "check the column(s) or drop them from %s", kind, ", ".join(names), flag)
    if flat_builtin := [name for name in flat if name not in user]:
        _warn_flat_builtin(flat_builtin)


def _warn_flat_builtin(flat_builtin: list[str]) -> None:
    """The warning for built-in features that never change, with the data that causes it."""
    why = []
    if set(flat_builtin) - {"log_volume"}:
        why.append("bars whose open, high and low equal their close (close-only data) do this for the price "
                   "features")
    if "log_volume" in flat_builtin:
        why.append("a volume that never changes (a feed without volume, all zero) does it for log_volume")
    log.warning("built-in feature(s) %s never change over the training bars: the model learns nothing from "
                "them (harmless). %s; check the columns and their mapping flags", ", ".join(flat_builtin),
                "; ".join(why)[:1].upper() + "; ".join(why)[1:])


def warn_about_series(frame: FeatureFrame, train_anchors: np.ndarray, need: int) -> None:
    """Warn about a symbol without a training window (the server forecasts it untrained), and about one whose
    bars are mostly spaced unlike the run's bar interval (its future times would be spaced wrongly)."""
    anchors = np.sort(train_anchors)
    for s, e in frame.series_bounds:
        symbol = frame.symbols[int(frame.series_id[s])]
        if np.searchsorted(anchors, e) == np.searchsorted(anchors, s):
            log.warning("symbol %s has no training window (%d bars; a window needs %d of one symbol in the training "
                        "split): the model will know it but not have learnt it; give it more bars or leave it out",
                        symbol, e - s, need)
        own = infer_bar_interval_ns(frame.timestamp_ns, np.array([[s, e]]))
        if own and own != frame.bar_interval_ns:
            coarse = own >= max(NS_PER_DAY, COARSE_INTERVALS * frame.bar_interval_ns)
            refused = (" (and the server refuses bars closer than half the model's interval: it would refuse this "
                       "symbol's)" if 2 * own < frame.bar_interval_ns else
                       " (and the server refuses bars mostly a day and 20 of the model's intervals apart at one time "
                       "of day: it would refuse this symbol's if they are daily bars)" if coarse else "")
            log.warning("symbol %s: its bars are mostly %.6g s apart, the run's bar interval is %.6g s (the most "
                        "common spacing of all bars): its forecasts' future bar times would be spaced by the "
                        "latter%s; train bars of different sizes separately", symbol, own / 1e9,
                        frame.bar_interval_ns / 1e9, refused)


@dataclass(frozen=True)
class ReadBars:
    """Bars read already (per contract for a contract run), trained on in place of a file: backtest's folds."""

    bars: Bars
    contracts: ContractConfig | None  # the run's contracts (scan_contracts of their file); None: plain series
    name: str  # what they are, in messages and as the checkpoint's data_source

    def __str__(self) -> str:
        return self.name


def prepare(source: str | Path | ReadBars, cfg: TrainConfig, columns: ColumnMap | None = None,
            symbols: list[str] | None = None, normalization: Normalization | None = None,
            features: FeatureConfig | None = None) -> PreparedData:
    """Read bars, compute features, split, fit the categorical vocabularies and the normalisation (unless given,
    as on resume: `symbols`, `normalization` and `features`, the run's fitted feature config)."""
    try:
        fc, read = _read(source, cfg, columns or ColumnMap(), features)
        if features is None and cfg.calendar_tz == EXCHANGE_ZONE:
            fc = replace(fc, calendar_tz=_exchange_zone(read, fc))
        bars, rolls = as_series(read, fc)
    except ContractError as exc:
        raise DataError(str(exc)) from None
    for note in bars.notes:
        log.info("bars: %s", note)
    if len(bars) == 0:
        raise DataError(f"{source}: no bars (the file holds no rows); give bars to train on")
    digest = training_digest(bars, fc)
    if features is None:  # vocabularies and trading hours of the training split: the bars before validation
        before = split_times(bars.timestamp_ns, cfg.val_fraction, cfg.test_fraction)[0]
        fc = with_trading_hours(with_vocabularies(fc, bars, before), bars, before)
    frame = _frame(bars, fc, symbols)
    del bars  # the frame holds what training needs; keeping the bars would double the peak
    starts, ends, b_val, b_test, cuts = split_rows(frame, cfg.val_fraction, cfg.test_fraction)
    train, val, test = split_anchors(frame, cfg, starts, ends, b_val, b_test)
    train_rows = np.concatenate([np.arange(s, b) for s, b in zip(starts, b_val, strict=True)])
    if normalization is None:
        normalization = fit_normalization(frame, train, train_rows)
    profile = training_profile(frame, train_rows) if cfg.seasonal_scale else None
    warn_about_series(frame, train, cfg.volatility_window + cfg.encoder_length + cfg.horizon)
    clim = np.quantile(frame.targets[train], cfg.quantiles, axis=0).T.astype(np.float32)  # [H, Q]
    return PreparedData(frame, WindowTensors(frame, cfg.encoder_length), train, val, test, normalization, clim,
                        (int(cuts[0]), int(cuts[1])), digest, rolls, profile, read.dropped)


def _exchange_zone(bars: Bars, fc: FeatureConfig) -> str:
    """--calendar-tz exchange: the zone of the exchange most of the bars' roots trade on (logged), else UTC; UTC for
    daily or coarser bars too, whose time stamps the session's date."""
    if len(bars) == 0 or infer_bar_interval_ns(bars.timestamp_ns, bars.series_bounds()) >= NS_PER_DAY:
        return "UTC"
    try:
        roots = set(contract_roots(bars, fc.contracts).values()) if fc.contracts is not None else set()
    except ValueError:  # a name no rule maps: the roll's own error says so next
        roots = set()
    if (found := exchange_zone(roots)) is None:
        return "UTC"
    tz, theirs = found
    log.info("calendar time zone %s: the exchange's of %s (--calendar-tz exchange; give a zone to choose another)",
             tz, ", ".join(sorted(theirs)))
    return tz


def _read(source: str | Path | ReadBars, cfg: TrainConfig, columns: ColumnMap,
          features: FeatureConfig | None) -> tuple[FeatureConfig, Bars]:
    """The run's feature config and bars: a fresh run finds its contracts in the bars, a resumed one has `features`."""
    if isinstance(source, ReadBars):
        return features or replace(cfg.feature_config(), contracts=source.contracts), source.bars
    fc = features or replace(cfg.feature_config(), contracts=scan_contracts(source, columns, cfg.contract_flags))
    return fc, read_contract_bars(source, columns, fc)


def training_digest(bars: Bars, config: FeatureConfig) -> str:
    """bars_digest of the series trained on and every user column the run reads: its reals, and its categoricals'
    labels; for continuous series of contracts also each bar's contract and log offset (where the rolls fall)."""
    digest = bars_digest(bars, config.real_columns, config.categorical_columns)
    if bars.contract is None:
        return digest
    h = hashlib.blake2b(digest.encode(), digest_size=16)
    h.update("\0".join(np.asarray(bars.contract, dtype=str).tolist()).encode())
    if bars.log_offset is not None:  # None once ratio-adjusted: the prices hold the offsets
        h.update(np.ascontiguousarray(bars.log_offset, dtype=np.float64).tobytes())
    return h.hexdigest()


def _frame(bars: Bars, config: FeatureConfig, symbols: list[str] | None) -> FeatureFrame:
    """build_frame, its refusals (a static column varying in a series, a resumed run's unknown symbol) as DataError."""
    try:
        return build_frame(bars, config, symbols)
    except ValueError as exc:
        resumed = symbols is not None and not set(bars.series_slices()) <= set(symbols)
        raise DataError(f"{exc}: a resumed run keeps its checkpoint's symbols; drop the other symbols' bars, or "
                        "start a new run (without --resume) to train on them" if resumed else str(exc)) from None


def split_anchors(frame: FeatureFrame, cfg: TrainConfig, starts: np.ndarray, ends: np.ndarray, b_val: np.ndarray,
                  b_test: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The windows of each split, purged of H bars after each boundary; DataError for an empty split."""
    h, L = cfg.horizon, cfg.encoder_length
    train = anchor_rows(frame, L, True, (starts, b_val))
    val = anchor_rows(frame, L, True, (b_val + h, b_test))
    test = anchor_rows(frame, L, True, (b_test + h, ends)) if cfg.test_fraction > 0 else np.empty(0, np.int64)
    if train.size == 0:
        raise DataError(f"no training windows: each window needs {cfg.volatility_window + L + h} bars of one symbol "
                        f"(volatility warm-up {cfg.volatility_window} + encoder {L} + horizon {h}) inside the "
                        f"training split; the longest series has {int((ends - starts).max(initial=0))} bars. "
                        "Give more bars, or lower --encoder-length / --volatility-window / --val-fraction")
    if val.size == 0:
        raise DataError(f"no validation windows: the validation split ({cfg.val_fraction:.0%} of the bars' timestamps) "
                        f"must hold {L + h} bars of one symbol after a purge of {h} bars. Raise --val-fraction "
                        "or give more bars")
    if cfg.test_fraction > 0 and test.size == 0:
        raise DataError("no test windows: raise --test-fraction or set it to 0")
    if cfg.max_val_windows and val.size > cfg.max_val_windows:
        val = val[np.linspace(0, val.size - 1, cfg.max_val_windows).astype(np.int64)]
    return train, val, test


def fit_normalization(frame: FeatureFrame, train: np.ndarray, train_rows: np.ndarray) -> Normalization:
    """Normalisation over the training rows, target scales over the training windows; DataError if closes never move."""
    spread = np.nanstd(frame.targets[train], axis=0)  # [H]
    if not np.all(spread >= MIN_STD):
        raise DataError(f"the training split's closes never move: its log returns over 1..{spread.size} bars have a "
                        f"spread of {float(spread.min()):.3g}, so there is no scale to forecast in. Give bars with "
                        "trades (a flat, carried price has nothing to learn), a longer history or more symbols")
    warn_about_constant_features(frame, train_rows)
    schema = frame.schema
    static = NormStats.fit(frame.static_real, train_rows) if frame.static_real is not None else None
    return Normalization(_raw_categoricals(NormStats.fit(frame.observed, train_rows), schema.observed,
                                           schema.categorical(Role.OBSERVED)),
                         _raw_categoricals(NormStats.fit(frame.known, train_rows), schema.known,
                                           schema.categorical(Role.KNOWN)),
                         NormStats.fit(frame.targets, train).std, static)


def _raw_categoricals(stats: NormStats, names: list[str], categorical: list[str]) -> NormStats:
    """`stats` with mean 0 and std 1 for the categorical columns: their ids enter the model as they are."""
    if not categorical:
        return stats
    cat = np.isin(np.array(names), categorical)  # [C]
    return NormStats(np.where(cat, 0.0, stats.mean).astype(np.float32),
                     np.where(cat, 1.0, stats.std).astype(np.float32))
