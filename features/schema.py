"""The feature schema as data, and the canonical tensor names every stage (dataset, model, ONNX, server) uses."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

# canonical tensor names: model inputs, model outputs and the target
STATIC_CATEGORICAL = "static_categorical"  # int64   [B, n_static]        symbol id
ENCODER_OBSERVED = "encoder_observed"  # float32 [B, L, n_observed]  past bars' observed features
ENCODER_KNOWN = "encoder_known"  # float32 [B, L, n_known]     calendar features of past bars
DECODER_KNOWN = "decoder_known"  # float32 [B, H, n_known]     calendar features of future bars
MODEL_INPUTS: tuple[str, ...] = (STATIC_CATEGORICAL, ENCODER_OBSERVED, ENCODER_KNOWN, DECODER_KNOWN)
QUANTILES = "quantiles"  # float32 [B, H, Q]          cumulative log-return quantiles
ATTENTION = "attention"  # float32 [B, H, L + H]      decoder attention, mean over heads
STATIC_WEIGHTS = "static_weights"  # float32 [B, n_static]
ENCODER_WEIGHTS = "encoder_weights"  # float32 [B, L, n_observed + n_known]
DECODER_WEIGHTS = "decoder_weights"  # float32 [B, H, n_known]
EXPLAIN_OUTPUTS: tuple[str, ...] = (ATTENTION, STATIC_WEIGHTS, ENCODER_WEIGHTS, DECODER_WEIGHTS)
MODEL_OUTPUTS: tuple[str, ...] = (QUANTILES, *EXPLAIN_OUTPUTS)
TARGET = "target"  # float32 [B, H]  log(close[t+h] / close[t]), h = 1..H


class Role(StrEnum):
    """Where a feature enters the TFT."""

    STATIC = "static"  # constant per series
    OBSERVED = "observed"  # known only up to the last bar (encoder only)
    KNOWN = "known"  # computable for any future timestamp (encoder and decoder)


class Kind(StrEnum):
    REAL = "real"
    CATEGORICAL = "categorical"


@dataclass(frozen=True)
class FeatureSpec:
    """One model input variable."""

    name: str
    role: Role
    kind: Kind
    source: str = "builtin"  # "builtin" or "user" (a parquet column passed through)

    def to_dict(self) -> dict[str, str]:
        d = asdict(self)
        d["role"] = self.role.value
        d["kind"] = self.kind.value
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> FeatureSpec:
        return FeatureSpec(str(d["name"]), Role(d["role"]), Kind(d["kind"]), str(d.get("source", "builtin")))


@dataclass(frozen=True)
class FeatureSchema:
    """The ordered variables of each role; the order is the column order of every array."""

    features: tuple[FeatureSpec, ...]

    def names(self, role: Role) -> list[str]:
        return [f.name for f in self.features if f.role == role]

    @property
    def observed(self) -> list[str]:
        return self.names(Role.OBSERVED)

    @property
    def known(self) -> list[str]:
        return self.names(Role.KNOWN)

    @property
    def static(self) -> list[str]:
        return self.names(Role.STATIC)

    @property
    def user_columns(self) -> list[str]:
        return [f.name for f in self.features if f.source == "user"]

    def to_list(self) -> list[dict[str, str]]:
        return [f.to_dict() for f in self.features]

    @staticmethod
    def from_list(items: list[dict[str, Any]]) -> FeatureSchema:
        return FeatureSchema(tuple(FeatureSpec.from_dict(d) for d in items))
