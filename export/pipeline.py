"""checkpoint -> proved ONNX model: load, export, run the four checks in order, and only then write.

The first failed check raises CheckFailed and nothing is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib.metadata
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import torch
from torch import nn

from export import fp16 as fp16_mod
from export.calibrate import OFFSETS, CalibratedModel, calibrate
from export.errors import CheckFailed, UsageError, WriteFailed
from export.files import Staging, leftovers, remove
from export.onnx_export import check_interface, export_model, input_names, output_names, run_checker, signature
from export.options import ExportOptions
from export.parity import ParityReport, check_parity, make_cases
from export.placement import PlacementReport, evaluate, profile_placement
from export.runtime import CUDA_OPTIONS, Probe, make_session, probe
from export.triton import VERSION as TRITON_VERSION
from export.triton import config_pbtxt, newer_versions, repository_files
from export.windows import saved_windows, windows_from_bars
from features import package_version
from features.config import FeatureConfig
from features.files import link_note, print_report
from features.model_meta import ModelMeta, graph_digest, training_span
from features.schema import STATIC_CATEGORICAL, FeatureSchema
from trainer.checkpoint import CheckpointError, file_sha256, load_checkpoint, model_from_checkpoint
from trainer.model_config import ModelConfig
from trainer.modeling import TemporalFusionTransformer

# the model's normalisation buffers: kept float32 in --fp16 models (raw features need the digits)
NORMALIZATION_INITIALIZERS = ("observed_mean", "observed_std", "known_mean", "known_std")
STATIC_NORMALIZATION = ("static_mean", "static_std")  # also, in a model with static reals
REPORT_ALSO = "the model's metadata keeps the parity and placement reports"  # when stdout cannot take them

Tamper = Callable[[onnx.ModelProto], None]
Log = Callable[[str], None]


@dataclass
class ExportResult:
    output: Path
    meta: ModelMeta
    parity: ParityReport
    placement: PlacementReport
    triton_dir: Path | None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(opts: ExportOptions) -> tuple[dict[str, Any], TemporalFusionTransformer, str]:
    """The checkpoint, the rebuilt model in eval mode and the file's sha256; UsageError otherwise."""
    try:
        ckpt = load_checkpoint(opts.checkpoint)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    model = model_from_checkpoint(ckpt)
    for name, tensor in model.state_dict().items():  # else parity compares NaN with NaN and blames the graph
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UsageError(f"{opts.checkpoint}: weight {name!r} holds NaN or infinite values: the run that wrote "
                             "it diverged; export a checkpoint from before (the run's best, ckpt.pt, or retrain "
                             "with a lower --learning-rate)")
    return ckpt, model, file_sha256(opts.checkpoint)


def base_meta(ckpt: dict[str, Any], cfg: ModelConfig, sha: str, opts: ExportOptions) -> ModelMeta:
    """What the server needs, from the checkpoint; parity and placement are added after the checks."""
    exporter = {"tool": "python -m export", "foxhunt_tft": package_version(), "torch": str(torch.__version__),
                "onnx": onnx.__version__, "onnxruntime": ort.__version__,
                "onnxscript": importlib.metadata.version("onnxscript"), "opset": opts.opset,
                "torch_exporter": "torch.onnx.export(dynamo=True) (torch.export)",
                "trained_with_torch": str(ckpt["torch_version"])}
    if opts.fp16:
        exporter |= {"fp16_kept_fp32_ops": sorted(fp16_mod.KEEP_FP32_OPS),
                     "fp16_kept_fp32_initializers": list(fp32_initializers(cfg))}
    version = sha[:12] + "-fp16" * opts.fp16 + "-noexplain" * (not opts.explain) + "-calibrated" * opts.calibrate
    meta = ModelMeta(model_config=cfg.to_dict(), feature_config=FeatureConfig.from_dict(ckpt["feature_config"]),
                     feature_schema=FeatureSchema.from_list(ckpt["feature_schema"]), quantiles=cfg.quantiles,
                     horizon=cfg.horizon, encoder_length=cfg.encoder_length,
                     bar_interval_ns=int(ckpt["bar_interval_ns"]), symbols=tuple(str(s) for s in ckpt["symbols"]),
                     checkpoint_sha256=sha, model_version=version, explain=opts.explain, precision=opts.precision,
                     column_map=dict(ckpt["column_map"]), training=training_span(ckpt),
                     input_stats={k: v for k, v in ckpt["normalization"].items() if k != "target_scale"},
                     exporter=exporter)
    meta.check()
    return meta


def fp32_initializers(cfg: ModelConfig) -> tuple[str, ...]:
    """The buffers an --fp16 graph keeps in float32: the input normalisation and the calibration offsets."""
    return (*NORMALIZATION_INITIALIZERS, *(STATIC_NORMALIZATION if cfg.n_static_real else ()), OFFSETS)


_EXPORTS: OrderedDict[tuple[str, int, bool, str], bytes] = OrderedDict()  # the last 4 graphs traced


def _export_cached(net: CalibratedModel, example: dict[str, torch.Tensor], opts: ExportOptions,
                   sha: str) -> onnx.ModelProto:
    """export_model, memoised per checkpoint, opset and explain: tracing takes seconds, and a backtest exports
    each fold's checkpoint calibrated and not. Each caller gets a copy holding `net`'s calibration offsets."""
    key = (sha, opts.opset, opts.explain, str(torch.__version__))
    if key not in _EXPORTS:
        _EXPORTS[key] = export_model(net, example, opts.opset, opts.explain).SerializeToString()
        while len(_EXPORTS) > 4:
            _EXPORTS.popitem(last=False)
    _EXPORTS.move_to_end(key)
    proto = onnx.load_model_from_string(_EXPORTS[key])
    (offsets,) = (t for t in proto.graph.initializer if t.name.rsplit(".", 1)[-1] == OFFSETS)
    offsets.CopyFrom(onnx.numpy_helper.from_array(getattr(net, OFFSETS).numpy(), offsets.name))
    return proto


def with_meta(proto: onnx.ModelProto, meta: ModelMeta) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    del out.metadata_props[:]
    onnx.helper.set_model_props(out, meta.to_props())
    out.producer_name, out.producer_version = "foxhunt-tft export", package_version()
    out.doc_string = (f"foxhunt-tft Temporal Fusion Transformer ({meta.precision}), checkpoint sha256 "
                      f"{meta.checkpoint_sha256}; inputs {', '.join(i.name for i in proto.graph.input)}; see "
                      "metadata_props foxhunt.*")
    return out


def with_digest(proto: onnx.ModelProto, meta: ModelMeta) -> tuple[ModelMeta, bytes, onnx.ModelProto]:
    """`meta` with the graph's digest (checked by the server on load), and the final model's bytes and proto."""
    meta = dataclasses.replace(meta, graph_sha256=graph_digest(with_meta(proto, meta).SerializeToString()))
    final = with_meta(proto, meta)
    return meta, final.SerializeToString(), final


def build_graph(net: CalibratedModel, cfg: ModelConfig, windows: dict[str, np.ndarray], opts: ExportOptions, sha: str,
                meta: ModelMeta, tamper: Tamper | None) -> onnx.ModelProto:
    """`net`, the TFT of `cfg` with its calibration, as an ONNX graph (fp16 with --fp16) with `meta`."""
    example = {name: torch.from_numpy(windows[name][:2]) for name in input_names(cfg)}
    if example[STATIC_CATEGORICAL].shape[0] < 2:  # torch.export specialises a batch of 1
        example = {name: x.repeat((2,) + (1,) * (x.dim() - 1)) for name, x in example.items()}
    proto = _export_cached(net, example, opts, sha)
    if opts.fp16:
        kept = fp32_initializers(cfg)
        keep = [t.name for t in proto.graph.initializer if t.name.rsplit(".", 1)[-1] in kept]
        if len(keep) != len(kept):
            raise CheckFailed("fp16 conversion", f"expected the initializers kept in float32 {list(kept)} in the "
                              f"exported graph, found {keep}. Export without --fp16")
        proto = fp16_mod.convert_to_fp16(proto, keep)
    lowest_ir_version(proto)
    if tamper is not None:
        tamper(proto)
    return with_meta(proto, meta)


def lowest_ir_version(proto: onnx.ModelProto) -> None:
    """The oldest IR version the graph's opsets allow, so older runtimes (an older Triton's) load it too."""
    with contextlib.suppress(ValueError):  # an opset this onnx does not know: the exporter's version stays
        proto.ir_version = min(proto.ir_version, onnx.helper.find_min_ir_version_for(list(proto.opset_import)))


def check_parity_gate(model_bytes: bytes, model: TemporalFusionTransformer, net: nn.Module,
                      windows: dict[str, np.ndarray], opts: ExportOptions, device: str
                      ) -> tuple[ParityReport, dict[str, np.ndarray]]:
    """Check 3: the graph against `net`, what was exported; returns the report and the real windows' feeds, reused
    by the placement run."""
    session = make_session(model_bytes, device, opts.threads)
    cases = make_cases(windows, model)
    parity = check_parity(model, net, session, cases, opts.precision)
    parity.provider_options = dict(CUDA_OPTIONS) if device == "cuda" else {}
    print_report(parity.table(), REPORT_ALSO)
    if not parity.passed:
        worst = max(parity.failures(), key=lambda r: r.scaled)
        raise CheckFailed("parity", f"{len(parity.failures())} of {len(parity.rows)} comparisons exceed the "
                          f"tolerance {parity.tolerance:g}; worst: {worst.output} on {worst.case} (scaled error "
                          f"{worst.scaled:.3g}{', ' + worst.note if worst.note else ''}). The ONNX graph does not "
                          "compute what the PyTorch model computes; do not serve it")
    return parity, cases[0].inputs


def write_outputs(data: bytes, opts: ExportOptions, meta: ModelMeta, final: onnx.ModelProto, log: Log = _stderr,
                  published: list[Path] | None = None) -> Path | None:
    """All or nothing: the model file and the Triton model directory, added to `published` once in place."""
    triton_dir = None if opts.triton_repo is None else opts.triton_repo / opts.model_name
    try:
        with Staging() as staging:
            _clear_leftovers(opts.output, log)
            staging.file(opts.output, data)
            if note := link_note(opts.output):
                log(note)
            if triton_dir is not None:
                _clear_leftovers(triton_dir, log, in_triton=True)
                config = config_pbtxt(opts.model_name, signature(list(final.graph.input)),
                                      signature(list(final.graph.output)), opts.triton_max_batch_size,
                                      comment=f"written by `python -m export` from checkpoint sha256 "
                                              f"{meta.checkpoint_sha256}\nfoxhunt-tft {meta.precision} model, "
                                              f"version {meta.model_version}")
                staging.directory(triton_dir, repository_files(data, config), keep_others=True)
            staging.commit(published)
    except OSError as exc:  # Staging names the target it was writing
        target = Path(exc.filename) if exc.filename else opts.output
        advice = (f"free space on the file system of {target.parent.resolve()}, or write elsewhere"
                  if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "check the path and its permissions")
        raise WriteFailed(f"cannot write {target}: {exc.strerror or exc}; {advice}") from None
    return triton_dir


def _clear_leftovers(target: Path, log: Log, in_triton: bool = False) -> None:
    """Remove the staged copies a killed export left beside `target`; name any backup of a model directory."""
    staged, backups = leftovers(target)
    for path in staged:
        remove(path)
        log(f"removed {path}, a partial write left by a killed export"
            + (" (Triton would take it for a model)" if in_triton else ""))
    for path in backups:
        log(f"warning: {path} is a copy of {target} set aside by an export killed while publishing; Triton would "
            "take it for a model: remove it, or move it back if the model directory is missing")


def run_export(opts: ExportOptions, log: Log = _stderr, *, published: list[Path] | None = None,
               _tamper: Tamper | None = None) -> ExportResult:
    """Export `opts.checkpoint` or raise ExportError; outputs go to `published` once in place. `_tamper`, a test
    hook, may change the graph."""
    torch.set_num_threads(opts.threads)
    dev = _device(opts)
    ckpt, model, sha = load(opts)
    meta = base_meta(ckpt, model.cfg, sha, opts)
    windows, source = _real_windows(opts, ckpt, model.cfg, log)
    _log_checkpoint(opts, ckpt, model.cfg, meta, sha,
                    f"{windows[STATIC_CATEGORICAL].shape[0]} real windows {source}", log)
    calibration = (calibrate(ckpt, model, opts.run_bars or opts.bars, opts.column_flags, log, opts.calibrate_median)
                   if opts.calibrate else None)
    # every graph ends in the calibration stage, an uncalibrated one's offsets zero: one trace serves both
    net = CalibratedModel(model, np.zeros((model.cfg.horizon, len(model.cfg.quantiles)), np.float32)
                          if calibration is None else calibration.offsets)
    log(f"exporting with torch.onnx.export(dynamo=True), opset {opts.opset}, {opts.precision}"
        f"{'' if opts.explain else ', quantiles only'} ...")
    proto = build_graph(net, model.cfg, windows, opts, sha, meta, _tamper)
    parity, placement = _checks(proto, model, net, windows, source, opts, dev, log)
    meta = dataclasses.replace(meta, parity=parity.to_dict(), placement=placement.to_dict(),
                               calibration=None if calibration is None else calibration.to_dict())
    meta, data, final = with_digest(proto, meta)
    triton_dir = write_outputs(data, opts, meta, final, log, published)
    log(f"wrote {opts.output} ({len(data) / 2**20:.2f} MiB, {meta.precision}, opset {opts.opset}, sha256 "
        f"{hashlib.sha256(data).hexdigest()})" + (f" and Triton model {triton_dir}" if triton_dir else ""))
    if triton_dir is not None and (later := newer_versions(triton_dir)):
        log(f"note: {triton_dir} also holds version(s) {', '.join(later)}, kept as they were; the config.pbtxt "
            f"written serves version {TRITON_VERSION} alone (version_policy), the model just exported")
    return ExportResult(opts.output, meta, parity, placement, triton_dir)


def _device(opts: ExportOptions) -> Probe:
    """Whether the required device loads (else where the model would run here), said before minutes of work."""
    dev = probe(opts.require_device or "cuda")
    if opts.require_device and not dev.available:
        raise UsageError(f"--require-device {opts.require_device}: {dev.reason}. Export on a machine where "
                         "onnxruntime-gpu loads CUDA, or drop --require-device to export here without the "
                         "placement gate (the report then shows where each node runs on this machine)")
    return dev


def _real_windows(opts: ExportOptions, ckpt: dict[str, Any], cfg: ModelConfig, log: Log
                  ) -> tuple[dict[str, np.ndarray], str]:
    if opts.bars is not None:
        return windows_from_bars(opts.bars, ckpt, cfg, opts.column_flags, log=log), f"rebuilt from {opts.bars}"
    return saved_windows(ckpt), "from the checkpoint's validation sample"


def _log_checkpoint(opts: ExportOptions, ckpt: dict[str, Any], cfg: ModelConfig, meta: ModelMeta, sha: str,
                    windows: str, log: Log) -> None:
    log(f"checkpoint {opts.checkpoint} (sha256 {sha[:12]}): hidden {cfg.hidden_size}, encoder {cfg.encoder_length}, "
        f"horizon {cfg.horizon}, quantiles {list(cfg.quantiles)}, {len(meta.symbols)} symbol(s); {windows}")
    epoch, best = int(ckpt["epoch"]), int(ckpt["best_epoch"])
    if best and epoch != best:  # ckpt.last.pt, most likely: exported as asked, but said
        log(f"note: {opts.checkpoint} holds epoch {epoch}; the run's best validation loss was at epoch {best}, in "
            "its best checkpoint (ckpt.pt beside ckpt.last.pt): export that one for the best model")


def _checks(proto: onnx.ModelProto, model: TemporalFusionTransformer, net: nn.Module, windows: dict[str, np.ndarray],
            source: str, opts: ExportOptions, dev: Probe, log: Log) -> tuple[ParityReport, PlacementReport]:
    cfg = model.cfg
    run_checker(proto)
    log("[1/4] onnx.checker (full): ok")
    check_interface(proto, cfg, opts.explain, opts.opset)
    log(f"[2/4] opset {opts.opset}; inputs {list(input_names(cfg))} and outputs {list(output_names(opts.explain))}: "
        "names, dtypes, dynamic batch axis ok")
    device = dev.device if dev.available else "cpu"
    model_bytes = proto.SerializeToString()
    parity, feeds = check_parity_gate(model_bytes, model, net, windows, opts, device)
    parity.real_windows = f"{windows[STATIC_CATEGORICAL].shape[0]} {source}"
    log(f"[3/4] parity: ok (max scaled error {max(r.scaled for r in parity.rows):.2e} <= {parity.tolerance:g})")
    if opts.precision == "fp16" and parity.provider == "CPUExecutionProvider":
        log("warning: --fp16 parity ran on ONNX Runtime's CPU provider, which computes most fp16 nodes in fp32: "
            "this checked the weights' rounding to fp16, not fp16 arithmetic as a GPU runs it; export again with "
            "--require-device cuda on a CUDA machine before serving it there")
    provider, nodes = profile_placement(model_bytes, device, feeds, opts.threads)
    placement = evaluate(PlacementReport(opts.require_device, provider, nodes), opts.require_device)
    print_report(placement.table(), REPORT_ALSO)
    if placement.gate == "failed":
        raise CheckFailed("placement", placement.reason)
    log(f"[4/4] placement gate: {placement.gate}")
    return parity, placement
