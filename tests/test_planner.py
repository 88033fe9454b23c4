"""The VRAM budget as a contract, on the CPU: the memory model, the plan, the refusals, the CLI, the OOM fallback.

The GPU half (the cap on a real card, peak against budget) is in scripts/gpu_check.sh and
the `gpu`-marked test at the end.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from features.schema import DECODER_KNOWN, ENCODER_KNOWN, ENCODER_OBSERVED, STATIC_CATEGORICAL, TARGET
from features.synth import generate
from tests.artifacts import REPO, TINY_TRAIN_FLAGS, make_bars, run, run_main
from trainer import planner
from trainer.checkpoint import load_checkpoint
from trainer.config import TrainConfig
from trainer.data import unshared_rows
from trainer.loop import Trainer
from trainer.model_config import ModelConfig
from trainer.modeling import TemporalFusionTransformer
from trainer.plan import TrainPlan
from trainer.planner import Affine, MemoryModel, PlanError, Target

CPU = torch.device("cpu")
NO_CUDA = not torch.cuda.is_available()
TINY = ModelConfig(n_observed=6, n_known=4, static_cardinalities=(2,), hidden_size=16, attention_heads=2,
                   dropout=0.1, encoder_length=12, horizon=3)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def bars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bars(tmp_path_factory.mktemp("planner") / "bars.parquet", bars=1500)


def tiny_model(seed: int = 0) -> TemporalFusionTransformer:
    torch.manual_seed(seed)
    return TemporalFusionTransformer(TINY)


def windows_fn(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    L, H = TINY.encoder_length, TINY.horizon
    return {STATIC_CATEGORICAL: torch.randint(0, 2, (n, 1), generator=g),
            ENCODER_OBSERVED: torch.randn(n, L, TINY.n_observed, generator=g),
            ENCODER_KNOWN: torch.randn(n, L, TINY.n_known, generator=g),
            DECODER_KNOWN: torch.randn(n, H, TINY.n_known, generator=g),
            TARGET: torch.randn(n, H, generator=g)}


def batch_fn(n: int) -> dict[str, torch.Tensor]:
    """n windows as the planner's trial steps take them (forward_rows, no bar shared)."""
    return unshared_rows(windows_fn(n))


# ---- budgets ---------------------------------------------------------------------------------


def test_parse_budget_units() -> None:
    assert planner.parse_budget("4GiB") == 4 * 2**30
    assert planner.parse_budget("512MiB") == 512 * 2**20
    assert planner.parse_budget("4GB") == 4 * 10**9
    assert planner.parse_budget("1.5 gib") == 3 * 2**29
    assert planner.parse_budget("64KiB") == 65536
    assert planner.parse_budget(".5GiB") == 2**29
    for bad in ("4", "four GiB", "4XB", ""):
        with pytest.raises(PlanError, match=r"expected a size with a unit"):
            planner.parse_budget(bad)
    for bad in ("0GiB", "-1GiB", "-4 GiB"):  # a size, but none a budget can be
        with pytest.raises(PlanError, match=r"must be more than 0 bytes"):
            planner.parse_budget(bad)


# ---- the memory model ------------------------------------------------------------------------------


def test_activations_grow_linearly_with_the_batch_and_drop_with_checkpointing() -> None:
    model = tiny_model()
    trial = planner.Trial(model, batch_fn, CPU, "fp32")
    sizes = (2, 4, 8)
    with trial.restoring():
        off = {n: trial.train_step(n, False) for n in sizes}
        on = {n: trial.train_step(n, True) for n in sizes}
        val = {n: trial.val_step(n) for n in sizes}
    for measured in (off, on):  # the same bytes per window from 2 to 4 as from 4 to 8
        slope_a = (measured[4] - measured[2]) / 2
        slope_b = (measured[8] - measured[4]) / 4
        assert slope_a > 0 and abs(slope_b - slope_a) <= 0.1 * slope_a, measured
    assert (val[8] - val[4]) / 4 == pytest.approx((val[4] - val[2]) / 2, rel=0.1)
    # checkpointing stores only block boundaries: the peak (one block recomputed) drops
    assert on[8] < off[8], (on, off)
    # validation under inference_mode stores nothing: its peak is below training's
    assert val[8] < off[8]
    # the trial left the model as it was: no gradients, train mode, checkpointing off
    assert all(p.grad is None for p in model.parameters())
    assert model.training and not model.gradient_checkpointing


def test_gradients_with_and_without_checkpointing_match() -> None:
    model = tiny_model()
    batch = windows_fn(5)
    grads = []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        model.train()
        model.gradient_checkpointing = ckpt
        torch.manual_seed(123)  # the same dropout masks (checkpoint replays the RNG state in its recompute)
        out = model(batch[STATIC_CATEGORICAL], batch[ENCODER_OBSERVED], batch[ENCODER_KNOWN], batch[DECODER_KNOWN])
        (out.quantiles.square().mean() + out.attention.mean()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_measured_memory_model_terms() -> None:
    model = tiny_model()
    target = Target("cuda", CPU, "bf16", "test")
    mem = planner.measure_memory(model, batch_fn, target)
    n_params = sum(p.numel() for p in model.parameters())
    assert mem.parameters == n_params
    assert mem.grad_bytes == 4 * n_params and mem.optimizer_bytes == 8 * n_params
    assert mem.cast_bytes == 2 * n_params  # assumed bf16 copies: the CPU measurement has none
    assert mem.step_temp_bytes == 4 * n_params  # one fp32 copy of the parameters bounds AdamW's step on CUDA
    assert mem.train_ckpt.per_window < mem.train.per_window
    # the estimate is persistent + max(activations + casts, step temporaries), linear in the micro-batch
    assert mem.train_bytes(10, False) == mem.persistent_bytes + mem.cast_bytes + mem.activation_bytes(10, False)
    assert mem.train_bytes(9, False) < mem.train_bytes(10, False)


# ---- choosing the plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("fits", [1, 3, 5, 13])
def test_planner_picks_the_largest_micro_batch_that_fits(fits: int) -> None:
    mem = planner.measure_memory(tiny_model(), batch_fn, Target("cuda", CPU, "bf16", "test"))
    # a budget whose usable part lies between the estimates for `fits` and `fits + 1` windows
    usable = (mem.train_bytes(fits, False) + mem.train_bytes(fits + 1, False)) // 2
    budget = math.ceil(usable / (1.0 - planner.SAFETY_FRACTION))
    assert mem.train_bytes(fits, False) <= planner.usable_bytes(budget) < mem.train_bytes(fits + 1, False)
    plan = planner.choose_plan(mem, budget, 64, "off", "bf16")
    assert (plan.micro_batch, plan.batch_size, plan.accumulation) == (fits, 64, math.ceil(64 / fits))
    assert not plan.grad_checkpointing and plan.budget_bytes == budget
    assert mem.val_bytes(plan.val_batch) <= planner.usable_bytes(budget) < mem.val_bytes(plan.val_batch + 1) \
        or plan.val_batch == 64
    assert plan.estimate_bytes <= planner.usable_bytes(budget)
    # a budget above the whole batch takes it in one micro-step
    big = planner.choose_plan(mem, 10 * mem.train_bytes(64, False), 64, "auto", "bf16")
    assert (big.micro_batch, big.accumulation) == (64, 1)


def synthetic(off: float, on: float, val: float = 1.0, persistent: int = 0) -> MemoryModel:
    return MemoryModel(parameters=1, weight_bytes=persistent, grad_bytes=0, optimizer_bytes=0, cast_bytes=0,
                       step_temp_bytes=0, resident_bytes=0, train=Affine(off, 0.0), train_ckpt=Affine(on, 0.0),
                       val=Affine(val, 0.0), trial_sizes=(2, 4), measured_on="synthetic")


def test_auto_turns_checkpointing_on_only_when_it_is_needed() -> None:
    budget = math.ceil(1000 / (1.0 - planner.SAFETY_FRACTION))  # 1000 bytes usable
    # without checkpointing 10 windows fit: off
    assert not planner.choose_plan(synthetic(100, 10), budget, 64, "auto", "bf16").grad_checkpointing
    # 2 windows without, 20 with: on
    plan = planner.choose_plan(synthetic(500, 50), budget, 64, "auto", "bf16")
    assert plan.grad_checkpointing and plan.micro_batch == 20
    # 2 without, 3 with: not worth the recompute
    assert not planner.choose_plan(synthetic(500, 300), budget, 64, "auto", "bf16").grad_checkpointing
    # nothing fits without, 5 with: on
    assert planner.choose_plan(synthetic(2000, 200), budget, 64, "auto", "bf16").micro_batch == 5
    # forced either way
    assert planner.choose_plan(synthetic(100, 10), budget, 64, "on", "bf16").grad_checkpointing
    with pytest.raises(PlanError, match=r"does not fit even a micro-batch of 1.*--grad-checkpointing auto"):
        planner.choose_plan(synthetic(2000, 200), budget, 64, "off", "bf16")
    # a training step fits but a validation forward of one window does not
    with pytest.raises(PlanError, match="validation"):
        planner.choose_plan(synthetic(100, 10, val=2000), budget, 64, "auto", "bf16")


def test_refusal_names_the_budget_that_would_fit() -> None:
    mem = synthetic(3000, 2500, persistent=500)
    with pytest.raises(PlanError) as info:
        planner.choose_plan(mem, 1000, 8, "auto", "bf16")
    message = str(info.value)
    assert "does not fit even a micro-batch of 1 window" in message
    need = math.ceil(mem.train_bytes(1, True) / (1.0 - planner.SAFETY_FRACTION))
    assert f"Raise --vram-budget to {planner.budget_flag(need)} or more" in message
    assert planner.budget_flag(1.2 * 2**30) == "1.2GiB" and planner.budget_flag(3 * 2**20 + 1) == "4MiB"
    assert planner.budget_flag(1000) == "1KiB"


# ---- the command line ------------------------------------------------------------------------------


def test_plan_only_plans_for_a_cuda_card_on_any_machine(bars: Path, tmp_path: Path) -> None:
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS,
                  "--device", "cuda", "--vram-budget", "1MiB", "--plan-only"])
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for term in ("VRAM plan for CUDA", "weights", "gradients", "AdamW state", "bf16 weight copies",
                 "activations per window", "validation per window", "plan: micro-batch", "estimated peak",
                 "set_per_process_memory_fraction", "assumptions:"):
        assert term in out, term
    if NO_CUDA:
        assert "planned for a CUDA card from a CPU measurement" in out
    assert not (tmp_path / "ckpt.pt").exists()  # nothing trained


@pytest.mark.parametrize(("budget", "why"), [("256KiB", "does not fit even a micro-batch of 1 window"),
                                              ("100KiB", "does not fit even a micro-batch of 1 window")])
def test_plan_only_refuses_when_one_window_does_not_fit(bars: Path, tmp_path: Path, budget: str, why: str) -> None:
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS,
                  "--device", "cuda", "--vram-budget", budget, "--plan-only"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    shown = budget.replace("KiB", ".00 KiB")
    assert f"error: the VRAM budget {shown} {why}" in r.stderr, r.stderr[-2000:]
    assert "Raise --vram-budget" in r.stderr


def test_plan_only_on_the_cpu(bars: Path, tmp_path: Path) -> None:
    """--device cpu: the budget is reported as not applicable, the plan is the config with its estimate."""
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS,
                  "--vram-budget", "4GiB", "--plan-only"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "memory plan for CPU" in r.stdout
    assert "not applicable on the CPU" in r.stdout
    assert "plan: micro-batch 32 x 1 accumulation step(s) = effective batch 32" in r.stdout


def test_vram_budget_on_the_cpu_is_not_applicable_and_training_runs(bars: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt.pt"
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *TINY_TRAIN_FLAGS, "--epochs", "2",
                  "--max-steps-per-epoch", "2", "--vram-budget", "4GiB"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--vram-budget 4GiB is not applicable on the CPU" in r.stderr
    # peak memory of every epoch, training and validation apart, in the metrics file and the checkpoint
    records = [json.loads(line) for line in out.with_suffix(".metrics.jsonl").read_text().splitlines()]
    assert [rec["epoch"] for rec in records] == [1, 2]
    for rec in records:
        for phase in ("train", "val"):
            assert rec["peak_memory"][phase]["kind"] == "cpu_peak_rss"
            assert rec["peak_memory"][phase]["bytes"] > 0
    ckpt = load_checkpoint(out.with_suffix(".last.pt"))
    assert ckpt["peak_memory"] == [rec["peak_memory"] for rec in records]


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_vram_budget_without_cuda_is_refused_for_training(bars: Path, tmp_path: Path, device: str) -> None:
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS,
                  "--device", device, "--vram-budget", "4GiB"])
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "--vram-budget 4GiB caps CUDA device memory, but CUDA is not available here" in r.stderr
    assert "--plan-only" in r.stderr and "--device cpu" in r.stderr
    assert not (tmp_path / "ckpt.pt").exists()
    if device == "cuda":  # a budget from a config file (a preset's) is named as such, not as a flag never given
        (tmp_path / "preset.toml").write_text('vram_budget = "4GiB"\n')
        r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS,
                      "--device", device, "--config", str(tmp_path / "preset.toml")])
        assert r.returncode == 2 and (f"vram_budget = '4GiB' (from --config {tmp_path / 'preset.toml'}) caps CUDA "
                                      "device memory") in r.stderr, r.stderr[-3000:]


def test_bad_budget_is_a_clear_error(bars: Path, tmp_path: Path) -> None:
    r = run_main(["-m", "trainer", "--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS,
                  "--vram-budget", "lots", "--plan-only"])
    assert r.returncode == 2
    assert "error: --vram-budget 'lots': expected a size with a unit, e.g. 4GiB" in r.stderr


# ---- the out-of-memory fallback ------------------------------------------------------------------------------


def test_out_of_memory_halves_the_micro_batch_and_keeps_training(sample_bars: Path, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    cfg = TrainConfig.from_dict(dict(hidden_size=8, attention_heads=2, encoder_length=20, horizon=3, batch_size=32,
                                     epochs=1, max_steps_per_epoch=3, max_val_windows=100, threads=1, device="cpu"))
    trainer = Trainer(sample_bars, cfg, tmp_path / "ckpt.pt", progress=False,
                      plan_fn=lambda model, data, device, precision: TrainPlan(16, 32, False, precision, 32))
    real_step = trainer.micro_step
    chunks: list[int] = []

    def flaky_step(anchors: torch.Tensor, weight: float) -> float:
        if not chunks:
            chunks.append(-anchors.numel())
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        chunks.append(anchors.numel())
        return real_step(anchors, weight)

    trainer.micro_step = flaky_step  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="trainer"):
        result = trainer.run()
    assert "out of memory: micro-batch halved to 8, accumulation 4 steps (effective batch 32 kept)" in caplog.text
    assert (trainer.plan.micro_batch, trainer.plan.batch_size, trainer.plan.accumulation) == (8, 32, 4)
    assert chunks == [-16] + [8] * 12  # the failed step retried whole: 3 optimizer steps of 4 x 8 windows
    assert trainer.step == 3 and result.epochs_run == 1
    assert result.history[0]["micro_batch"] == 8
    ckpt = load_checkpoint(result.paths.last)
    assert ckpt["plan"]["micro_batch"] == 8 and ckpt["plan"]["accumulation"] == 4
    assert "out of memory: micro-batch -> 8" in ckpt["plan"]["notes"]
    assert ckpt["peak_memory"][0]["train"]["bytes"] > 0 and ckpt["peak_memory"][0]["val"]["bytes"] > 0


def test_out_of_memory_at_one_window_is_a_clear_exit_3(bars: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.__main__ import main

    def always_oom(self: Trainer, anchors: torch.Tensor, weight: float) -> float:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")

    monkeypatch.setattr(Trainer, "micro_step", always_oom)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        rc = main(["--parquet", str(bars), "--out", str(tmp_path / "ckpt.pt"), *TINY_TRAIN_FLAGS])
    finally:
        signal.signal(signal.SIGTERM, handler)
    err = capsys.readouterr().err
    assert rc == 3
    assert "error: out of device memory with nothing left to halve" in err and "(injected)" in err
    assert "Traceback" not in err


# ---- the production preset ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_production_preset_plans_under_4gib(tmp_path: Path) -> None:
    """The seed's production configuration: 225 observed features, hidden 256, encoder 100, batch 128."""
    bars = tmp_path / "wide.parquet"
    pq.write_table(generate(["ES", "NQ"], 1200, seed=7, extra_features=220), bars)  # user columns f000..f219
    t0 = time.perf_counter()
    r = run_main(["-m", "trainer", "--config", str(REPO / "presets" / "production.toml"), "--parquet", str(bars),
                  "--plan-only", "--threads", "1"])
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout, f"\n(--plan-only took {seconds:.1f} s)")
    assert "budget 4.00 GiB" in r.stdout and "effective batch 128" in r.stdout
    assert "model: 94,295,769 parameters" in r.stdout  # 225 observed + 4 known variables, hidden 256; seasonal scale
    plan_line = next(line for line in r.stdout.splitlines() if line.startswith("plan: micro-batch"))
    micro = int(plan_line.split()[2])
    assert 1 <= micro < 128
    assert "effective batch 128" in plan_line


# ---- on a GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA device")
def test_cuda_run_stays_under_its_budget(bars: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt.pt"
    budget = 256 * 2**20
    r = run(["-m", "trainer", "--parquet", str(bars), "--out", str(out), *TINY_TRAIN_FLAGS, "--device", "cuda",
             "--vram-budget", "256MiB"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "set_per_process_memory_fraction" in r.stderr and "plan: micro-batch" in r.stderr
    assert "confirmed on the card: a step of" in r.stderr  # the plan was proven with a real step first
    for line in out.with_suffix(".metrics.jsonl").read_text().splitlines():
        peak = json.loads(line)["peak_memory"]
        assert peak["train"]["kind"] == "cuda_max_allocated"
        assert 0 < peak["train"]["bytes"] <= budget and 0 < peak["val"]["bytes"] <= budget
        assert peak["train"]["bytes"] <= peak["train"]["reserved_bytes"] <= budget  # the cap bounds reserved


# ---- the memory model's arithmetic, on known terms ------------------------------------------------------
def synthetic_memory() -> MemoryModel:
    return MemoryModel(parameters=25, weight_bytes=100, grad_bytes=100, optimizer_bytes=200, cast_bytes=0,
                       step_temp_bytes=1000, resident_bytes=0, train=Affine(10.0, 0.0),
                       train_ckpt=Affine(5.0, 0.0), val=Affine(1.0, 0.0), trial_sizes=(2, 4), measured_on="synthetic")


def test_the_training_peak_is_persistent_memory_plus_the_larger_of_activations_and_the_optimizer_step() -> None:
    mem = synthetic_memory()
    # persistent 100 + 100 + 200 = 400; 5 windows' activations (50) < AdamW's step temporaries (1000)
    assert mem.train_bytes(5, False) == 400 + 1000
    assert mem.train_bytes(200, False) == 400 + 2000  # activations (2000) above the step's 1000


def test_the_validation_peak_keeps_weights_and_adamw_state_but_no_gradients() -> None:
    assert synthetic_memory().val_bytes(7) == 100 + 200 + 7  # weights + AdamW state + 7 windows' forward


def test_the_affine_fit_passes_through_both_trial_points() -> None:
    line = Affine.through([(2, 100), (4, 160)])
    assert (line.per_window, line.fixed) == (30.0, 40.0) and line.at(2) == 100 and line.at(4) == 160
    shrinking = Affine.through([(2, 100), (4, 90)])  # never a negative slope: flat through the second
    assert (shrinking.per_window, shrinking.fixed) == (0.0, 90.0)
