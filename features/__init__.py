"""Bars in, feature arrays out: the torch-free code the trainer and the server share, so they cannot drift."""

import importlib.metadata

from features.bars import BarDataError, Bars, ColumnMap, Problem, read_bars
from features.calendar import known_features
from features.compute import FeatureFrame, build_frame
from features.config import FeatureConfig
from features.normalize import NormStats
from features.schema import FeatureSchema, FeatureSpec, Kind, Role


def package_version() -> str:
    """The installed foxhunt-tft version, recorded in checkpoints, models and GetModelInfo."""
    try:
        return importlib.metadata.version("foxhunt-tft")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__all__ = ["BarDataError", "Bars", "ColumnMap", "FeatureConfig", "FeatureFrame", "FeatureSchema", "FeatureSpec", "Kind",
           "NormStats", "Problem", "Role", "build_frame", "known_features", "package_version", "read_bars"]
