"""The ONNX model's `metadata_props`: everything the server needs, written by export.

Torch-free, so the server can read and validate a model file without importing torch.
Every value is a string; structured values are JSON.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from features.bars import ColumnMap
from features.compute import FeatureConfig
from features.schema import FeatureSchema

FORMAT = "foxhunt-tft-onnx/1"
# A model whose calendar features are in a time zone other than UTC: a server from before the zone would
# read its metadata without it and compute them in UTC; this format makes such a server refuse the model.
FORMAT_ZONED = "foxhunt-tft-onnx/2"
FORMATS = (FORMAT, FORMAT_ZONED)
PREFIX = "foxhunt."
TRAINING_KEYS = ("first_bar_ns", "validation_from_ns", "test_from_ns", "last_bar_ns")  # ModelMeta.training


METADATA_PROPS_FIELD = 14  # ModelProto.metadata_props, in onnx.proto
GRAPH_FIELD = 7  # ModelProto.graph
# ops whose first input's values reach their output unchanged (selected or reshaped): lookup_rows follows
# the symbol ids through these only, so no table indexed by something computed from them is taken for theirs
VALUE_KEEPING_OPS = frozenset({"Cast", "Flatten", "Gather", "Identity", "Reshape", "Slice", "Squeeze", "Unsqueeze"})


class ModelMetaError(ValueError):
    """An ONNX model whose metadata is missing or inconsistent; the server refuses it."""


def graph_digest(model_bytes: bytes) -> str:
    """sha256 of a serialized ONNX model without its `metadata_props`: the graph, its weights, opsets and
    header, as the file stores them. Export records it in the metadata (which it cannot cover); a loader
    that computes another knows the graph changed after export's checks (a flipped bit in a weight still
    parses). The top-level fields are walked in the protobuf wire format, so the digest is of the stored
    bytes, whatever protobuf library reads them; ValueError for bytes that are not a protobuf message."""
    data = memoryview(model_bytes)
    digest = hashlib.sha256()
    for number, start, _, end in _fields(data):
        if number != METADATA_PROPS_FIELD:
            digest.update(data[start:end])
    return digest.hexdigest()


def stored_props(model_bytes: bytes) -> dict[str, str]:
    """The model's `metadata_props` as the file stores them, read without a runtime session (ValueError for
    bytes that are not a protobuf message): a loader checks them, and the graph digest, before it builds one."""
    data = memoryview(model_bytes)
    props = {}
    for number, _, payload, end in _fields(data):
        if number == METADATA_PROPS_FIELD:  # StringStringEntryProto: key = 1, value = 2
            record = data[payload:end]
            try:
                entry = {n: bytes(record[p:e]).decode("utf-8") for n, _, p, e in _fields(record) if n in (1, 2)}
            except UnicodeDecodeError:  # protobuf strings are UTF-8: a byte of this one was damaged
                if PREFIX.encode() not in bytes(record):
                    continue  # not ours: a loader leaves the file to ONNX Runtime, whose error says what it is
                raise ModelMetaError(f"a metadata record at byte {payload} is not UTF-8 text: the file was damaged "
                                     "after export; copy it again, or re-export the model") from None
            props[entry.get(1, "")] = entry.get(2, "")
    return props


def lookup_rows(model_bytes: bytes, indices: str) -> int | None:
    """Rows of the table that the graph's first Gather of an initializer by values derived from input
    `indices` looks up (the symbol embedding, for static_categorical), read from the stored graph without a
    runtime: a loader checks the vocabulary the metadata names against it on any provider (CUDA's Gather
    reads an out-of-range id as zeros instead of failing). None when there is no such Gather; ValueError for
    bytes that are not a protobuf message."""
    data = memoryview(model_bytes)
    graph = next((data[p:e] for n, _, p, e in _fields(data) if n == GRAPH_FIELD), None)
    if graph is None:
        return None
    nodes: list[tuple[str, list[str], list[str]]] = []  # (op_type, inputs, outputs), in the graph's order
    rows: dict[str, int] = {}  # initializer name -> its first dimension
    for number, _, payload, end in _fields(graph):
        record = graph[payload:end]
        if number == 1:  # NodeProto: input = 1, output = 2, op_type = 4
            fields = [(n, bytes(record[p:e]).decode("utf-8", "replace")) for n, _, p, e in _fields(record)
                      if n in (1, 2, 4)]
            nodes.append((next((v for n, v in fields if n == 4), ""), [v for n, v in fields if n == 1],
                          [v for n, v in fields if n == 2]))
        elif number == 5:  # TensorProto: dims = 1 (varints, or packed), name = 8
            name, first = "", None
            for n, key_at, p, e in _fields(record):
                if n == 8:
                    name = bytes(record[p:e]).decode("utf-8", "replace")
                elif n == 1 and first is None:
                    first = _varint(record, p)[0] if record[key_at] & 7 == 0 else _varint(record[p:e], 0)[0]
            if first is not None:
                rows[name] = first
    derived = {indices}  # tensors holding the input's values, reshaped or selected, never computed on
    for op_type, inputs, outputs in nodes:
        if op_type == "Gather" and len(inputs) > 1 and inputs[1] in derived and inputs[0] in rows:
            return rows[inputs[0]]
        if inputs and inputs[0] in derived and op_type in VALUE_KEEPING_OPS:
            derived.update(outputs)
    return None


def _fields(data: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """The top-level fields of a protobuf message: (field number, start of its key, start of its payload
    (a length-delimited field's bytes), end)."""
    i, n = 0, len(data)
    while i < n:
        start = i
        key, i = _varint(data, i)
        wire, payload = key & 7, i
        if wire == 0:
            i = _varint(data, i)[1]
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, payload = _varint(data, i)
            i = payload + length
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {start}: not an ONNX model")
        if i > n:
            raise ValueError(f"a field at byte {start} runs past the end of the file: truncated")
        yield key >> 3, start, payload, i


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    """The protobuf varint at byte i, and the index after it."""
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError(f"a malformed varint at byte {i}: not an ONNX model")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


@dataclass(frozen=True)
class ModelMeta:
    model_config: dict[str, Any]  # trainer ModelConfig as a dict
    feature_config: FeatureConfig
    feature_schema: FeatureSchema
    quantiles: tuple[float, ...]
    horizon: int
    encoder_length: int
    bar_interval_ns: int
    symbols: tuple[str, ...]
    checkpoint_sha256: str
    model_version: str  # a short id: the checkpoint hash's first 12 hex digits, -fp16, -noexplain as exported
    explain: bool  # the model also returns attention and variable-selection weights
    precision: str  # fp32 | fp16 (inputs and outputs are float32 either way)
    column_map: dict[str, str] = field(default_factory=dict)
    exporter: dict[str, Any] = field(default_factory=dict)  # library versions, opset
    parity: dict[str, Any] = field(default_factory=dict)  # the parity report export proved
    placement: dict[str, Any] = field(default_factory=dict)  # the placement gate's report
    # the training run's bars in time (`training_span`): absent from models exported before it was recorded
    training: dict[str, Any] = field(default_factory=dict)
    graph_sha256: str = ""  # graph_digest of the model file as exported ('' before it was recorded)

    @functools.cached_property
    def symbol_index(self) -> dict[str, int]:
        """Symbol -> its id, the static input (the vocabulary's order)."""
        return {s: i for i, s in enumerate(self.symbols)}

    @property
    def bars_required(self) -> int:
        """Bars per series a request must carry: warm-up of the rolling features plus the encoder."""
        return self.feature_config.warmup_bars + self.encoder_length

    def to_props(self) -> dict[str, str]:
        values: dict[str, Any] = {
            "format": FORMAT if self.feature_config.calendar_tz == "UTC" else FORMAT_ZONED,
            "model_config": self.model_config,
            "feature_config": self.feature_config.to_dict(),
            "feature_schema": self.feature_schema.to_list(),
            "quantiles": list(self.quantiles),
            "horizon": self.horizon,
            "encoder_length": self.encoder_length,
            "bars_required": self.bars_required,
            "bar_interval_ns": self.bar_interval_ns,
            "symbols": list(self.symbols),
            "checkpoint_sha256": self.checkpoint_sha256,
            "model_version": self.model_version,
            "explain": self.explain,
            "precision": self.precision,
            "column_map": self.column_map,
            "exporter": self.exporter,
            "parity": self.parity,
            "placement": self.placement,
            **({"training": self.training} if self.training else {}),
            **({"graph_sha256": self.graph_sha256} if self.graph_sha256 else {}),
        }
        return {PREFIX + k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}

    @staticmethod
    def from_props(props: dict[str, str]) -> ModelMeta:
        """Parse and check; ModelMetaError names the first missing or bad key."""
        if props.get(PREFIX + "format") not in FORMATS:
            raise ModelMetaError(f"not a foxhunt-tft model: metadata '{PREFIX}format' is "
                                 f"{props.get(PREFIX + 'format')!r}, expected one of {', '.join(FORMATS)}. Export "
                                 "it with `python -m export ckpt.pt model.onnx`")

        def get(key: str, json_value: bool = True) -> Any:
            if PREFIX + key not in props:
                raise ModelMetaError(f"model metadata lacks '{PREFIX}{key}'; re-export the model")
            raw = props[PREFIX + key]
            try:
                return json.loads(raw) if json_value else raw
            except json.JSONDecodeError:
                raise ModelMetaError(f"model metadata '{PREFIX}{key}' is not valid JSON") from None

        try:
            meta = ModelMeta(
                model_config=dict(get("model_config")),
                feature_config=FeatureConfig.from_dict(get("feature_config")),
                feature_schema=FeatureSchema.from_list(get("feature_schema")),
                quantiles=tuple(float(q) for q in get("quantiles")),
                horizon=int(get("horizon")),
                encoder_length=int(get("encoder_length")),
                bar_interval_ns=int(get("bar_interval_ns")),
                symbols=tuple(str(s) for s in get("symbols")),
                checkpoint_sha256=str(get("checkpoint_sha256", json_value=False)),
                model_version=str(get("model_version", json_value=False)),
                explain=bool(get("explain")),
                precision=str(get("precision", json_value=False)),
                column_map=dict(get("column_map")),
                exporter=dict(get("exporter")),
                parity=dict(get("parity")),
                placement=dict(get("placement")),
                training=_training(get("training")) if PREFIX + "training" in props else {},
                graph_sha256=str(get("graph_sha256", json_value=False)) if PREFIX + "graph_sha256" in props else "",
            )
        except ModelMetaError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelMetaError(f"model metadata is inconsistent: {exc}") from None
        if PREFIX + "graph_sha256" in props and re.fullmatch(r"[0-9a-f]{64}", meta.graph_sha256) is None:
            raise ModelMetaError(f"model metadata '{PREFIX}graph_sha256' is not a sha256 (64 hex digits): the file "
                                 "was damaged or edited after export; re-export the model")
        if props[PREFIX + "format"] == FORMAT and meta.feature_config.calendar_tz != "UTC":
            raise ModelMetaError(f"model metadata is inconsistent: calendar time zone "
                                 f"{meta.feature_config.calendar_tz!r} in a {FORMAT} model (a zone needs "
                                 f"{FORMAT_ZONED}); re-export the model")
        meta.check()
        return meta

    def check(self) -> None:
        problems = []
        if self.horizon != self.feature_config.horizon:
            problems.append(f"horizon {self.horizon} != feature_config.horizon {self.feature_config.horizon}")
        if self.horizon < 1 or self.encoder_length < 1:
            problems.append("horizon and encoder_length must be >= 1")
        q = list(self.quantiles)
        if not q or any(not 0.0 < x < 1.0 for x in q) or any(b <= a for a, b in itertools.pairwise(q)):
            problems.append(f"quantiles must be a non-empty list of strictly increasing levels in (0, 1), not {q}")
        if not self.symbols:
            problems.append("symbol vocabulary is empty")
        elif len(set(self.symbols)) != len(self.symbols):
            problems.append("symbols must be unique: the vocabulary has duplicates")
        elif not all(self.symbols):  # a request names its series: "" is no name (the bars refuse it too)
            problems.append("symbols must be non-empty names: the training bars named a series ''; retrain with "
                            "every series named")
        if self.bar_interval_ns <= 0:
            problems.append("bar_interval_ns must be > 0")
        if (computed := self.feature_config.schema()).to_list() != self.feature_schema.to_list():
            problems.append((f"feature_schema's user columns {self.feature_schema.user_columns} are not those "
                             f"feature_config computes ({computed.user_columns})" if computed.user_columns !=
                             self.feature_schema.user_columns else "feature_schema is not what feature_config "
                             "computes") + " (edited after export?); re-export the model")
        if self.precision not in ("fp32", "fp16"):
            problems.append(f"precision {self.precision!r} is not fp32 or fp16")
        try:  # the training bars' names and time unit: the scorer reads bars with them
            ColumnMap.from_dict(self.column_map)
        except (TypeError, ValueError) as exc:
            problems.append(f"column_map: {exc}")
        if self.training and not _span_ok(self.training):
            problems.append(f"training must map {', '.join(TRAINING_KEYS)} to int64 nanoseconds (or null; "
                            f"validation_from_ns set) in time order, not {self.training!r}")
        if problems:
            raise ModelMetaError("model metadata is inconsistent: " + "; ".join(problems))


def _span_ok(training: dict[str, Any]) -> bool:
    """The four keys, each an int64 (never a bool) or null, validation_from_ns set, in time order."""
    if set(training) != set(TRAINING_KEYS) or training["validation_from_ns"] is None:
        return False
    if any(v is not None and (type(v) is not int or not -(2**63) <= v < 2**63) for v in training.values()):
        return False
    first, val, test, last = (training[k] for k in TRAINING_KEYS)
    times = [t for t in (first, val, test) if t is not None]
    return times == sorted(times) and (last is None or last + 1 >= times[-1])


def _training(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ModelMetaError(f"model metadata '{PREFIX}training' must be a JSON object of {', '.join(TRAINING_KEYS)}, "
                             f"not {type(value).__name__}; re-export the model")
    return value


def training_span(ckpt: dict[str, Any]) -> dict[str, Any]:
    """When the checkpoint's run trained, validated and tested, as UTC nanoseconds: `first_bar_ns`,
    `validation_from_ns`, `test_from_ns` (None without a test split) and `last_bar_ns`. Empty for a
    checkpoint that did not record its split."""
    split, span = ckpt.get("split_times_ns"), ckpt.get("data_span_ns")
    if not split or len(split) != 2:
        return {}
    test_fraction = float((ckpt.get("train_config") or {}).get("test_fraction", 0.0))
    val_from, test_from = int(split[0]), int(split[1])
    first, last = (int(span[0]), int(span[1])) if span and len(span) == 2 else (None, None)
    if last is None and not test_fraction > 0:
        last = test_from - 1  # without a test split the run's cut after its last bar
    return {"first_bar_ns": first, "validation_from_ns": val_from,
            "test_from_ns": test_from if test_fraction > 0 else None, "last_bar_ns": last}
