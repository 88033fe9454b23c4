"""The known features of any bar times, past or future: the calendar, then a `calendar:N` model's contract features.
Both come from timestamps (and the known expirations) alone, so training, the trainer's batches and the server
compute them by one rule."""

from __future__ import annotations

import numpy as np

from features.calendar import NS_PER_SECOND, DayOffsets, known_features
from features.config import FeatureConfig
from features.rolls import contract_known
from features.sessions import next_bar_times


def builtin_known(timestamp_ns: np.ndarray, roots: np.ndarray | None, config: FeatureConfig,
                  offsets: DayOffsets | None = None) -> np.ndarray:
    """float32 [..., n_builtin_known] at bar times `timestamp_ns` [...]: the calendar (time of day, day of week in
    config.calendar_tz), then for a `calendar:N` model the contract features of each bar's root (`roots`, str,
    broadcastable to the times). `offsets`: the calendar zone's precomputed offsets (a trainer's, over its bars'
    span). ValueError (one line) past the last known expiration's roll."""
    if offsets is None:
        calendar = known_features(timestamp_ns, config.calendar_tz)  # [..., 4]
    else:  # the same, at local wall-clock time
        calendar = known_features(timestamp_ns + offsets.at(timestamp_ns // NS_PER_SECOND))
    if not config.contract_known:
        return calendar
    assert config.contracts is not None
    if roots is None:
        raise ValueError("a calendar-rolled model's contract features need each series' root")
    contract = contract_known(timestamp_ns, roots, config.contracts, config.calendar_tz)  # [..., 2]
    return np.concatenate([calendar, contract], axis=-1)


def future_known(last_ns: np.ndarray, config: FeatureConfig, bar_interval_ns: int, roots: np.ndarray | None = None,
                 user: np.ndarray | None = None, offsets: DayOffsets | None = None) -> np.ndarray:
    """The decoder's known features of windows whose last bar is at `last_ns` [B], float32 [B, H, n_known]: the
    calendar of the H future bar times (future_times of the series `roots` [B]), a `calendar:N` model's contract
    features there (from the rule and the known expirations), then `user` [B, H, n_known_user], the user known
    variables' future values, when given. Training windows, the trainer's batches and the server's windows all
    take them from here, and the server's validation asks it whether a forecast has a front. `offsets`: the
    calendar zone's precomputed offsets (a trainer's, over its bars' span and after). ValueError (one line) past
    the last known expiration's roll."""
    future = future_times(last_ns, config, bar_interval_ns, roots)  # [B, H]
    known = builtin_known(future, None if roots is None else np.asarray(roots)[:, None], config, offsets)
    return known if user is None else np.concatenate([known, user], axis=-1, dtype=np.float32)  # [B, H, n_known]


def future_times(last_ns: np.ndarray, config: FeatureConfig, bar_interval_ns: int,
                 series: np.ndarray | None = None) -> np.ndarray:
    """The times of the H bars after each `last_ns` [B], int64 [B, H]: within the trading hours the model learnt
    for each of `series` [B] (names; a contract model's are its roots) and out of a known root's holidays and early
    closes, every bar interval where it has none."""
    return next_bar_times(last_ns, bar_interval_ns, config.horizon, config.calendar_tz, config.hours_of(series),
                          series)
