"""The feature schema as data, and the canonical tensor names every stage (dataset, model, ONNX, server) uses."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

# canonical tensor names: model inputs, model outputs and the target
# A categorical variable's values in a float32 tensor are its ids (exact integers, 0 the unknown slot).
STATIC_CATEGORICAL = "static_categorical"  # int64   [B, n_static_cat]    symbol id, then user static ids
ENCODER_OBSERVED = "encoder_observed"  # float32 [B, L, n_observed]  past bars' observed features
ENCODER_KNOWN = "encoder_known"  # float32 [B, L, n_known]     known features of past bars
DECODER_KNOWN = "decoder_known"  # float32 [B, H, n_known]     known features of future bars
STATIC_REAL = "static_real"  # float32 [B, n_static_real]     user static reals; an input only when there are some
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
        return {**asdict(self), "role": self.role.value, "kind": self.kind.value}

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

    def categorical(self, role: Role) -> list[str]:
        return [f.name for f in self.features if f.role == role and f.kind == Kind.CATEGORICAL]

    @property
    def static_reals(self) -> list[str]:
        return [f.name for f in self.features if f.role == Role.STATIC and f.kind == Kind.REAL]

    @property
    def model_inputs(self) -> tuple[str, ...]:
        """The model's input tensors, in order: MODEL_INPUTS, then STATIC_REAL when there are static reals."""
        return (*MODEL_INPUTS, STATIC_REAL) if self.static_reals else MODEL_INPUTS

    def user(self, *roles: Role, kind: Kind | None = None) -> tuple[str, ...]:
        """The user variables of `roles`, role by role in array order; only those of `kind` when given."""
        return tuple(f.name for role in roles for f in self.features
                     if f.role == role and f.source == "user" and (kind is None or f.kind == kind))

    @property
    def user_columns(self) -> list[str]:
        return [f.name for f in self.features if f.source == "user"]

    def to_list(self) -> list[dict[str, str]]:
        return [f.to_dict() for f in self.features]

    @staticmethod
    def from_list(items: list[dict[str, Any]]) -> FeatureSchema:
        return FeatureSchema(tuple(FeatureSpec.from_dict(d) for d in items))
