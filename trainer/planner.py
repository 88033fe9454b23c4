"""The VRAM planner: fit a training run into a device-memory budget before its first step.

Estimated peak = persistent (weights, gradients, AdamW state, CUDA workspaces, 16-bit weight copies) + max(activations
of a forward + backward, optimizer.step() temporaries). Activations are affine in the windows of a micro-batch, measured
by two trial steps. The plan takes the largest micro-batch that fits the budget less a safety margin, prefers no
gradient checkpointing, and raises accumulation to keep the effective batch; if one window does not fit, `PlanError`.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

import numpy as np
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from features.schema import TARGET
from trainer.data import row_inputs
from trainer.device import autocast_factory
from trainer.loss import pinball_loss
from trainer.modeling import TemporalFusionTransformer, TFTOutput
from trainer.plan import TrainPlan, literal_plan

SAFETY_FRACTION = 0.10  # of the budget, kept free for allocator fragmentation, workspaces and estimate error
MIN_EFFICIENT_MICRO = 4  # below this many windows per micro-step, "auto" takes gradient checkpointing
TRIAL_SIZES = (2, 4)  # windows in the two trial steps

BatchFn = Callable[[int], dict[str, Tensor]]  # n -> a CPU batch of n windows (row_inputs and TARGET)


class PlanError(ValueError):
    """The run cannot fit its budget (or the budget cannot be used); the message says what to change."""


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_budget(text: str) -> int:
    """'4GiB' -> 4294967296; binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units, case-insensitive."""
    m = re.fullmatch(r"\s*([-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*([A-Za-z]+)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise PlanError(f"--vram-budget {text!r}: expected a size with a unit, e.g. 4GiB, 512MiB or 4GB "
                        "(KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB powers of 10)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise PlanError(f"--vram-budget {text!r}: must be more than 0 bytes")
    return n


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def budget_flag(n: float) -> str:
    """A --vram-budget value of at least n bytes, e.g. '4.6GiB', '513MiB', '293KiB'."""
    if n >= 2**30:
        return f"{math.ceil(n / 2**30 * 10) / 10:.1f}GiB"
    if n >= 2**20:
        return f"{math.ceil(n / 2**20)}MiB"
    return f"{math.ceil(n / 2**10)}KiB"


def usable_bytes(budget: int) -> int:
    """What the estimate may use of `budget`: the rest is the safety margin."""
    return int(budget * (1.0 - SAFETY_FRACTION))


@dataclass(frozen=True)
class Affine:
    """bytes = fixed + per_window * windows, through two measured points."""

    per_window: float
    fixed: float

    def at(self, windows: int) -> int:
        return math.ceil(self.fixed + self.per_window * windows)

    @staticmethod
    def through(points: Sequence[tuple[int, int]]) -> Affine:
        """The line through two (windows, bytes) points, its slope and intercept at least 0."""
        (b1, y1), (b2, y2) = points
        slope = max(0.0, (y2 - y1) / (b2 - b1))
        return Affine(slope, max(0.0, y2 - slope * b2))


class _LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of new tensor storages while active, each counted until freed (the CPU's max_memory_allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked: dict[int, weakref.finalize] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._tracked or storage.data_ptr() in inputs:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._tracked[key] = weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.pop(key, None)

    def __exit__(self, *exc: Any) -> None:
        for fin in list(self._tracked.values()):
            fin.detach()
        self._tracked.clear()
        super().__exit__(*exc)


@contextlib.contextmanager
def _peak_bytes(device: torch.device) -> Iterator[list[int]]:
    """Peak bytes allocated inside a `with` block above what was allocated before it, in the list it yields."""
    peak = [0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield peak
        torch.cuda.synchronize(device)
        peak[0] = int(torch.cuda.max_memory_allocated(device)) - base
    else:
        with _LiveTensorBytes() as live:
            yield peak
        peak[0] = live.peak


class Trial:
    """Trial steps on `model` with real windows; leaves weights, RNG and mode as it found them."""

    def __init__(self, model: TemporalFusionTransformer, batch_fn: BatchFn, device: torch.device,
                 precision: str) -> None:
        self.model, self.batch_fn, self.device = model, batch_fn, device
        self.autocast = autocast_factory(device, precision)
        self.quantiles = torch.tensor(model.cfg.quantiles, dtype=torch.float32, device=device)

    def _forward(self, n: int) -> tuple[TFTOutput, dict[str, Tensor]]:
        batch = {k: v.to(self.device) for k, v in self.batch_fn(n).items()}
        with self.autocast():
            return self.model.forward_rows(*row_inputs(batch)), batch

    def train_step(self, n: int, checkpointing: bool) -> int:
        """Peak bytes of one forward + backward of n windows."""
        self.model.train()
        self.model.gradient_checkpointing = checkpointing
        with _peak_bytes(self.device) as peak:
            out, batch = self._forward(n)
            pinball_loss(out.quantiles.float(), batch[TARGET], self.quantiles).mean().backward()
            del out, batch
        return peak[0]

    def val_step(self, n: int) -> int:
        """Peak bytes of one forward of n windows under inference_mode (as validation runs)."""
        self.model.eval()
        with _peak_bytes(self.device) as peak, torch.inference_mode():
            self._forward(n)
        return peak[0]

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """Gradients allocated (as in an accumulation micro-step), then everything put back."""
        model = self.model
        training, ckpt = model.training, model.gradient_checkpointing
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                yield
        finally:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            model.train(training)
            model.gradient_checkpointing = ckpt


@dataclass(frozen=True)
class MemoryModel:
    """Estimated peak device bytes of training and validation, as named terms (see the module docstring)."""

    parameters: int  # parameter count P
    weight_bytes: int  # parameters (fp32 master weights) and buffers
    grad_bytes: int  # one gradient per parameter, same dtype
    optimizer_bytes: int  # AdamW exp_avg + exp_avg_sq
    cast_bytes: int  # autocast's 16-bit weight copies, when assumed (0 when measured inside the activations)
    step_temp_bytes: int  # temporaries of optimizer.step(), after the activations are freed
    resident_bytes: int  # other memory resident after a warm-up step (CUDA workspaces); 0 on the CPU
    train: Affine  # peak of forward + backward without gradient checkpointing
    train_ckpt: Affine  # with gradient checkpointing
    val: Affine  # validation forward under inference_mode
    trial_sizes: tuple[int, int]  # windows in the two measured trial steps
    measured_on: str  # how the activations were measured

    @property
    def persistent_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.resident_bytes

    def activation_bytes(self, windows: int, checkpointing: bool) -> int:
        return (self.train_ckpt if checkpointing else self.train).at(windows)

    def train_bytes(self, micro_batch: int, checkpointing: bool) -> int:
        """Peak of a training step: persistent + max(forward/backward, optimizer step)."""
        fwd_bwd = self.cast_bytes + self.activation_bytes(micro_batch, checkpointing)
        return self.persistent_bytes + max(fwd_bwd, self.step_temp_bytes)

    def val_bytes(self, val_batch: int) -> int:
        """Peak of validation: weights, optimizer state and the transient of one forward (no gradients)."""
        return self.weight_bytes + self.optimizer_bytes + self.resident_bytes + self.cast_bytes + self.val.at(val_batch)


def largest_fitting(cost: Callable[[int], int], limit: int, cap: int) -> int:
    """Largest n in [1, cap] with cost(n) <= limit for a non-decreasing cost; 0 when not even 1 fits."""
    return bisect.bisect_right(range(1, cap + 1), limit, key=cost)


@dataclass(frozen=True)
class Option:
    checkpointing: bool
    micro_batch: int  # largest that fits, up to the effective batch (0 = not even 1)
    train_bytes: int  # estimated training peak at that micro-batch (at 1 when none fits)


def options_for(mem: MemoryModel, budget: int, batch_size: int) -> list[Option]:
    """For each checkpointing setting, the largest micro-batch that fits."""
    fitting = {ckpt: largest_fitting(functools.partial(mem.train_bytes, checkpointing=ckpt), usable_bytes(budget),
                                     batch_size) for ckpt in (False, True)}
    return [Option(ckpt, mb, mem.train_bytes(max(mb, 1), ckpt)) for ckpt, mb in fitting.items()]


def choose_plan(mem: MemoryModel, budget: int, batch_size: int, mode: str, precision: str) -> TrainPlan:
    """The plan for `budget` bytes; PlanError when not even one window fits (training or validation)."""
    limit = usable_bytes(budget)
    opts = {o.checkpointing: o for o in options_for(mem, budget, batch_size)}
    chosen, why = _choose_checkpointing(opts, batch_size, mode)
    notes = [f"budget {format_bytes(budget)}, usable {format_bytes(limit)} after a {SAFETY_FRACTION:.0%} margin", why]
    if chosen.micro_batch < 1:
        raise PlanError(_refusal(mem, budget, opts, mode))
    val_batch = largest_fitting(mem.val_bytes, limit, batch_size)
    if val_batch < 1:
        raise PlanError(f"the VRAM budget {format_bytes(budget)} fits a training micro-batch but not the "
                        f"validation forward of one window ({format_bytes(mem.val_bytes(1))} with the margin "
                        f"{format_bytes(budget - limit)} kept free); raise --vram-budget")
    mb = chosen.micro_batch
    estimate = max(mem.train_bytes(mb, chosen.checkpointing), mem.val_bytes(val_batch))
    notes.append(f"micro-batch {mb} x {math.ceil(batch_size / mb)} accumulation = batch {batch_size}; "
                 f"estimated peak {format_bytes(estimate)}")
    return TrainPlan(mb, batch_size, chosen.checkpointing, precision, val_batch, budget, estimate, tuple(notes))


def _choose_checkpointing(opts: dict[bool, Option], batch_size: int, mode: str) -> tuple[Option, str]:
    """The option to take, and why. "auto" prefers checkpointing off (it costs about a third more compute) unless
    the micro-batch without it is under MIN_EFFICIENT_MICRO windows and with it at least twice as large."""
    off, on = opts[False], opts[True]
    if mode != "auto":
        return (on if mode == "on" else off), f"gradient checkpointing {mode} (--grad-checkpointing {mode})"
    if off.micro_batch >= min(batch_size, MIN_EFFICIENT_MICRO) or (
            off.micro_batch >= 1 and on.micro_batch < 2 * off.micro_batch):
        return off, (f"gradient checkpointing off: micro-batch {off.micro_batch} without it, {on.micro_batch} with "
                     "it, not worth recomputing the forward")
    return on, (f"gradient checkpointing on: micro-batch {off.micro_batch or 'none'} without it, {on.micro_batch} "
                "with it")


def _refusal(mem: MemoryModel, budget: int, opts: dict[bool, Option], mode: str) -> str:
    best = min((o for o in opts.values() if mode == "auto" or o.checkpointing == (mode == "on")),
               key=lambda o: o.train_bytes)
    need = math.ceil(max(best.train_bytes, mem.val_bytes(1)) / (1.0 - SAFETY_FRACTION))
    per_window = ", ".join(f"{format_bytes(mem.activation_bytes(1, c))} with checkpointing {'on' if c else 'off'}"
                           for c in sorted(opts))
    hint = " or allow gradient checkpointing (--grad-checkpointing auto)," if mode == "off" else ""
    return (f"the VRAM budget {format_bytes(budget)} does not fit even a micro-batch of 1 window: weights, "
            f"gradients and AdamW state take {format_bytes(mem.weight_bytes + mem.grad_bytes + mem.optimizer_bytes)}"
            f" and one window's activations {per_window}, so a step needs {format_bytes(best.train_bytes)} and "
            f"the budget at least {format_bytes(need)} (with a {SAFETY_FRACTION:.0%} safety margin). Raise "
            f"--vram-budget to {budget_flag(need)} or more,{hint} or shrink the model "
            "(--hidden-size, fewer --features, --encoder-length)")


@dataclass(frozen=True)
class Target:
    """The device a plan is for, and how it is measured."""

    kind: str  # "cuda" or "cpu": the device the run will use
    measure_device: torch.device  # where the trial steps run
    precision: str  # fp32 | bf16 | fp16 on the target
    description: str  # for the table, e.g. "NVIDIA H200, 139.8 GiB" or "no CUDA here"

    @property
    def from_cpu(self) -> bool:
        return self.kind == "cuda" and self.measure_device.type != "cuda"


@dataclass(frozen=True)
class PlanReport:
    target: Target
    budget_bytes: int  # 0 = none (a literal plan, with estimates)
    batch_size: int
    mode: str  # --grad-checkpointing
    memory: MemoryModel
    options: tuple[Option, ...]
    plan: TrainPlan
    seconds: float
    notes: tuple[str, ...]


def assumptions_for(target: Target) -> tuple[str, ...]:
    if target.kind == "cpu":
        return ("figures are bytes of tensors (host memory); the process's resident memory is higher (the data, "
                "Python and its libraries)",)
    out = []
    if target.from_cpu:
        out += [
            "no CUDA here: activations were measured on the CPU in fp32 and are assumed the same size on the card "
            "(autocast saves little here: layer norms and softmax promote back to fp32)",
            "16-bit weight copies assumed at 2 bytes per parameter",
            "CUDA library workspaces (cuBLAS, cuDNN) are left to the safety margin",
        ]
    out += ["optimizer.step(): fused AdamW updates in place; one fp32 temporary per parameter is assumed as a bound",
            "peak is allocated memory (torch.cuda.max_memory_allocated); the cap "
            "(set_per_process_memory_fraction) bounds reserved memory, which is at least that"]
    return tuple(out)


def measure_memory(model: TemporalFusionTransformer, batch_fn: BatchFn, target: Target) -> MemoryModel:
    """Persistent terms from the parameters, activations from trial steps with and without checkpointing."""
    device = target.measure_device
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    cast = 2 * n_params if (target.from_cpu and target.precision != "fp32") else 0
    step_temp = grad_bytes if target.kind == "cuda" else max(p.numel() * p.element_size() for p in params)
    trial = Trial(model, batch_fn, device, target.precision if device.type == "cuda" else "fp32")
    resident = 0
    with trial.restoring():
        if device.type == "cuda":
            trial.train_step(1, False)  # warm-up: library workspaces and lazy initialisation
            torch.cuda.synchronize(device)
            resident = max(0, torch.cuda.memory_allocated(device) - weight_bytes - grad_bytes)
        train, train_ckpt = (Affine.through([(n, trial.train_step(n, ckpt)) for n in TRIAL_SIZES])
                             for ckpt in (False, True))
        for p in model.parameters():
            p.grad = None  # validation runs with gradients freed
        val = Affine.through([(n, trial.val_step(n)) for n in TRIAL_SIZES])
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
           else "bytes of tensor storages allocated, CPU, fp32")
    return MemoryModel(n_params, weight_bytes, grad_bytes, 2 * grad_bytes, cast, step_temp, resident, train,
                       train_ckpt, val, TRIAL_SIZES, how)


def plan_for_model(model: TemporalFusionTransformer, batch_fn: BatchFn, target: Target, budget: int,
                   batch_size: int, mode: str, stream: TextIO) -> PlanReport:
    """Measure and plan, printing the plan table to `stream`; PlanError, after the table that shows why, when the
    budget cannot hold one window. Without a budget, or on the CPU, the plan is the config taken literally, with
    its estimated peak."""
    t0 = time.perf_counter()
    try:
        mem = measure_memory(model, batch_fn, target)
    except torch.OutOfMemoryError:
        raise PlanError(f"trial steps of {TRIAL_SIZES[0]} and {TRIAL_SIZES[1]} windows ran out of memory under the "
                        f"VRAM cap of {format_bytes(budget)}: raise --vram-budget or shrink the model (--hidden-size, "
                        "fewer --features, --encoder-length)") from None
    torch.cuda.empty_cache()  # the trial steps' cached blocks would fragment the real run's pool (none on the CPU)
    if budget and target.kind == "cuda":
        report = _budget_report(model, batch_fn, target, budget, batch_size, mode, mem, t0, stream)
    else:
        report = _literal_report(target, budget, batch_size, mode, mem, time.perf_counter() - t0)
    print(format_report(report), file=stream, flush=True)
    return report


def _budget_report(model: TemporalFusionTransformer, batch_fn: BatchFn, target: Target, budget: int,
                   batch_size: int, mode: str, mem: MemoryModel, t0: float, stream: TextIO) -> PlanReport:
    """The plan for `budget`, confirmed on the card when measured there; a refusal's table goes to `stream`."""
    opts = tuple(options_for(mem, budget, batch_size))
    try:
        plan = choose_plan(mem, budget, batch_size, mode, target.precision)
    except PlanError as exc:
        failed = literal_plan(batch_size, mode, target.precision)
        refused = PlanReport(target, budget, batch_size, mode, mem, opts, failed, time.perf_counter() - t0,
                             ("REFUSED: " + str(exc),))
        print(format_report(refused, refused=True), file=stream, flush=True)
        raise
    notes: tuple[str, ...] = ()
    if target.measure_device.type == "cuda":
        plan = confirm_on_card(model, batch_fn, target, mem, plan)
        notes = plan.notes[-1:]
    return PlanReport(target, budget, batch_size, mode, mem, opts, plan, time.perf_counter() - t0, notes)


def _literal_report(target: Target, budget: int, batch_size: int, mode: str, mem: MemoryModel,
                    seconds: float) -> PlanReport:
    """No budget to plan for: the config taken literally, with its estimated peak."""
    plan = literal_plan(batch_size, mode, target.precision)
    ckpt = plan.grad_checkpointing
    estimate = max(mem.train_bytes(batch_size, ckpt), mem.val_bytes(batch_size))
    opts = (Option(ckpt, batch_size, mem.train_bytes(batch_size, ckpt)),)
    notes = ((f"--vram-budget {format_bytes(budget)} is not applicable on the CPU: it caps CUDA device memory",)
             if budget else ("no VRAM budget: the config taken literally",))
    plan = replace(plan, estimate_bytes=estimate, notes=notes)
    return PlanReport(target, budget, batch_size, mode, mem, opts, plan, seconds, notes)


def confirm_on_card(model: TemporalFusionTransformer, batch_fn: BatchFn, target: Target, mem: MemoryModel,
                    plan: TrainPlan) -> TrainPlan:
    """One real step of the chosen micro-batch under the cap, the AdamW state's bytes held beside it; on out
    of memory, a quarter fewer windows. The estimate is of allocated memory, the cap bounds reserved memory."""
    device = target.measure_device
    trial = Trial(model, batch_fn, device, target.precision)
    mb = plan.micro_batch
    state: Tensor | None  # the AdamW state's bytes
    while True:
        reserved = 0
        with trial.restoring(), contextlib.suppress(torch.OutOfMemoryError):
            state = torch.empty(mem.optimizer_bytes, dtype=torch.uint8, device=device)
            torch.cuda.reset_peak_memory_stats(device)
            trial.train_step(mb, plan.grad_checkpointing)
            reserved = int(torch.cuda.max_memory_reserved(device))
        state = None  # noqa: F841 - frees the held bytes before the next try
        torch.cuda.empty_cache()  # what a failed try cached must not count against the next
        if reserved:
            note = (f"confirmed on the card: a step of {mb} windows with the optimizer state held peaked at "
                    f"{format_bytes(reserved)} reserved of the {format_bytes(plan.budget_bytes)} cap")
            if mb != plan.micro_batch:
                note += f" (the estimate's {plan.micro_batch} windows ran out of memory)"
            return replace(plan, micro_batch=mb, notes=(*plan.notes, note))
        if mb == 1:
            raise PlanError(f"a training step of one window does not fit the VRAM cap of "
                            f"{format_bytes(plan.budget_bytes)} on the card, although the estimate said it would; "
                            "raise --vram-budget or pass --grad-checkpointing on")
        mb = max(1, mb - max(1, mb // 4))


def batch_fn_for(tensors: Any, anchors: np.ndarray) -> BatchFn:
    """Trial windows: the first n training anchors, repeated if fewer, no bar shared (the most memory n can take)."""

    def fn(n: int) -> dict[str, Tensor]:
        return tensors.row_batch(torch.from_numpy(np.resize(anchors, n)), share_bars=False)

    return fn


def format_report(r: PlanReport, refused: bool = False) -> str:
    """The plan table: what the run is planned for, the memory terms, the options and the plan chosen."""
    on_card = r.target.kind == "cuda"
    lines = [f"{'VRAM plan' if on_card else 'memory plan'} for {r.target.kind.upper()} ({r.target.description}), "
             f"precision {r.target.precision}, effective batch {r.batch_size}, gradient checkpointing {r.mode}"]
    if r.budget_bytes and on_card:
        lines.append(f"budget {format_bytes(r.budget_bytes)}: usable {format_bytes(usable_bytes(r.budget_bytes))}, "
                     f"{SAFETY_FRACTION:.0%} kept free for allocator fragmentation, library workspaces and "
                     "estimate error")
    rows = _term_rows(r)
    w = max(len(n) for n, _, _ in rows)
    lines += [*(r.notes if not refused else ()), f"model: {r.memory.parameters:,} parameters", "",
              f"  {'term':<{w}}  {'size':>11}  what it is", *(f"  {n:<{w}}  {s:>11}  {d}" for n, s, d in rows),
              "", *_option_lines(r, refused), "", *(r.notes if refused else _plan_lines(r)),
              "assumptions:", *(f"  - {a}" for a in assumptions_for(r.target)), f"planned in {r.seconds:.1f} s"]
    return "\n".join(lines)


def _term_rows(r: PlanReport) -> list[tuple[str, str, str]]:
    """(term, size, what it is) for each term of the memory model."""
    m, on_card = r.memory, r.target.kind == "cuda"
    rows = [
        ("weights", format_bytes(m.weight_bytes), f"{m.parameters:,} fp32 parameters (the master copy) and buffers"),
        ("gradients", format_bytes(m.grad_bytes), "fp32, one per parameter, kept across accumulation micro-steps"),
        ("AdamW state", format_bytes(m.optimizer_bytes), "exp_avg + exp_avg_sq, 2 x fp32 per parameter"),
    ]
    if on_card:
        cast_how = ("assumed, 2 B per parameter" if m.cast_bytes else
                    "none in fp32" if r.target.precision == "fp32" else "measured: inside the activations")
        rows.append((f"{r.target.precision} weight copies", format_bytes(m.cast_bytes),
                     f"autocast's casts, kept for the backward ({cast_how})"))
        rows.append(("resident after warm-up", format_bytes(m.resident_bytes),
                     "cuBLAS/cuDNN workspaces" + (" (measured on CUDA only)" if r.target.from_cpu else "")))
    bound = "one fp32 copy of the parameters" if on_card else "the largest parameter"
    rows.append(("optimizer.step() temporaries", format_bytes(m.step_temp_bytes),
                 f"fused AdamW, bounded by {bound}; max(step, activations), not a sum"))
    sizes = f"trial steps of {m.trial_sizes[0]} and {m.trial_sizes[1]} windows"
    for ckpt, s in ((False, m.train), (True, m.train_ckpt)):
        rows.append(("activations per window" + (", checkpointing" if ckpt else ""), format_bytes(s.per_window),
                     f"peak of forward+backward, {sizes} ({m.measured_on}); fixed part {format_bytes(s.fixed)}"))
    rows.append(("validation per window", format_bytes(m.val.per_window),
                 f"transient of a forward under torch.inference_mode; fixed part {format_bytes(m.val.fixed)}"))
    return rows


def _option_lines(r: PlanReport, refused: bool) -> list[str]:
    """One line per checkpointing setting: its largest micro-batch, the estimate, and whether it fits."""
    p, budgeted = r.plan, bool(r.budget_bytes) and r.target.kind == "cuda"
    lines = [f"  {'checkpointing':<13}  {'micro-batch':>11}  {'accumulation':>12}  {'est. training peak':>18}  fits"]
    for o in r.options:
        chosen = (not refused) and o.checkpointing == p.grad_checkpointing and o.micro_batch == p.micro_batch
        acc = str(math.ceil(r.batch_size / o.micro_batch)) if o.micro_batch else "-"
        fits = ("yes" if o.micro_batch else "no") if budgeted else "n/a"
        lines.append(f"  {'on' if o.checkpointing else 'off':<13}  {o.micro_batch or '-':>11}  {acc:>12}  "
                     f"{format_bytes(o.train_bytes):>18}  {fits}{'  <- chosen' if chosen else ''}")
    return lines


def _plan_lines(r: PlanReport) -> list[str]:
    """The plan chosen, its estimated peaks, and how the budget is enforced."""
    p, budgeted = r.plan, bool(r.budget_bytes) and r.target.kind == "cuda"
    last = r.batch_size - (p.accumulation - 1) * p.micro_batch
    tail = f" (the last holds {last})" if last != p.micro_batch else ""
    est_train = r.memory.train_bytes(p.micro_batch, p.grad_checkpointing)
    of = f" of the {format_bytes(r.budget_bytes)} budget" if budgeted else ""
    lines = [f"plan: micro-batch {p.micro_batch} x {p.accumulation} accumulation step(s) = effective batch "
             f"{p.batch_size}{tail}; gradient checkpointing {'on' if p.grad_checkpointing else 'off'}; "
             f"{p.precision}; validation batch {p.val_batch}",
             f"estimated peak: training {format_bytes(est_train)}, validation "
             f"{format_bytes(r.memory.val_bytes(p.val_batch))}{of}"]
    if budgeted:
        lines.append("enforced on the card by torch.cuda.set_per_process_memory_fraction(budget / total memory) "
                     "before the first step; an out-of-memory step halves the micro-batch and keeps the "
                     "effective batch")
    return lines
