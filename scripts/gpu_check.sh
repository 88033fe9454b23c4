#!/usr/bin/env bash
# Every check that needs a GPU, in one call of under 8 minutes, with a report under $OUT.
#
#   scripts/gpu_check.sh [--out DIR] [--budget 4GiB] [--steps N] [--python PY]
#                        [--ort-wheel PATH] [--wheels DIR] [--parts STAGE] [--deadline SECONDS]
#
# Writes (at most 8 files, so the whole folder can be carried back from a device machine):
#   report.md, report.json  every part as pass / fail / skipped-with-reason, and the figures
#   gpu_util.csv            nvidia-smi samples (every 200 ms) during the CUDA training run
#   plan_cpu.log            --plan-only for the production preset, planned from a CPU measurement
#   train_cuda.log          the bounded CUDA run under the budget (its plan was measured on the card)
#   train_cpu.log           the same run on CPU threads (throughput comparison)
#   export_serving.log      export with the CUDA placement gate, server latency on the CUDA provider
#   gpu_tests.log           the test suite's `gpu`-marked tests (fp32 and fp16 export on CUDA, the budget)
#
# Parts:
#   env          nvidia-smi, torch, onnxruntime and its execution providers
#   data         sample bars with the preset's 220 user columns (features.synth --extra-features)
#   plan_cpu     `--plan-only --device cuda` for presets/production.toml under the budget with CUDA
#                hidden: the plan a machine without a GPU prints, compared below with the card
#   train_cuda   the preset on CUDA under the budget for --steps optimizer steps: measured peak
#                (train and validation, torch.cuda.max_memory_allocated per epoch) against the budget
#                and against both plans' estimates; GPU utilisation sampled in the background
#   train_cpu    the same run on all CPU threads for a few steps: windows/s against CUDA
#   export       python -m export --require-device cuda (the placement gate), if ORT has CUDA
#   serving      benchmarks/serving_load.py: python -m serving --device cuda with the preset's model
#                against bare ONNX Runtime on CUDA, at 1, 8 and 64 concurrent clients
#   serving_packed   the same with the user columns sent packed (user_features_raw), then on PredictStream
#   serving_workers  packed, with --workers 4 (four server processes on one port)
#   gpu_tests    pytest -m gpu: export --require-device cuda in fp32 and fp16 (parity and placement on
#                CUDA: fp16's Clip and Cast nodes included) and a tiny CUDA run under a 256 MiB budget
#   serving_cpu  the same with the tiny test model on the CPU provider (an uncontended machine's figure), and
#                on PredictStream
#   serving_cpu_pinned  serving_cpu's model and clients with the server on two CPUs only (--server-cpus)
#
# Without a GPU it says so, runs the plan and a tiny CPU training run, and exits 0. The exit
# status is 1 only when a part that ran failed.
#
# onnxruntime: the export and serving parts need onnxruntime's CUDAExecutionProvider; a
# CPU-only onnxruntime reports them as not run. --ort-wheel PATH installs an onnxruntime-gpu
# wheel into a private --target directory first (nothing is fetched: the wheel must be
# local); --wheels DIR does the same for every wheel in DIR (e.g. grpcio-health-checking,
# grpcio-reflection, grpcio-status and googleapis-common-protos for the server, psutil for its benchmark;
# without uvloop the servers run on asyncio's loop, and the report says so). --parts STAGE joins
# the parts that `scripts/wheel_parts.sh split` made (checking their SHA-256) and installs the
# onnxruntime-gpu wheel among them as --ort-wheel, the others as --wheels.

set -uo pipefail

OUT=${OUT:-./gpu_report}
BUDGET=4GiB
STEPS=40
CPU_STEPS=2
PY=""
ORT_WHEEL=""
WHEELS=""
PARTS=""
PART_WHEELS=()  # wheels to install beside onnxruntime-gpu: from --parts and --wheels
DEADLINE_S=450  # stop starting new parts after this many seconds (the whole call must stay under 8 min)
BARS=4000       # per symbol, 2 symbols: ~6,000 training windows, enough for 40 steps of 128

usage() { sed -n '2,/^$/p' "$0" | sed -e '/^$/d' -e 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --ort-wheel) ORT_WHEEL=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --parts) PARTS=$2; shift 2 ;;
    --deadline) DEADLINE_S=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
RESULTS="$WORK/results.tsv"
FIGURES="$WORK/figures.jsonl"
: >"$RESULTS"
: >"$FIGURES"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
NPROC=$(nproc 2>/dev/null || echo 4)

log() { echo "[gpu_check $(date -u +%H:%M:%S)] $*" >&2; }
# record PART STATUS SECONDS DETAIL: one line of the report
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(echo "$4" | tr '\t\n' '  ')" >>"$RESULTS"; log "$1: $2 ($4)"; }
time_left() { [ "$SECONDS" -lt "$DEADLINE_S" ]; }
time_for() { [ $((SECONDS + $1)) -lt "$DEADLINE_S" ]; }  # time_for N: a part of about N seconds still fits
tail_of() { tail -c 600 "$1" 2>/dev/null | tr '\n' ' '; }

# ---- python and extra wheels ---------------------------------------------------------------
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
install_wheels() {  # install_wheels DIR WHEEL...: into a private target, first on PYTHONPATH
  local target=$1; shift
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@" \
    && export PYTHONPATH="$target:$PYTHONPATH"
}
link_nvidia() {  # link_nvidia DIR: onnxruntime.preload_dlls looks for NVIDIA's CUDA wheels beside onnxruntime
  local nv
  nv=$("$PY" -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null) || return 0
  [ -n "$nv" ] && [ ! -e "$1/nvidia" ] && ln -s "$nv" "$1/nvidia"
  return 0
}
if [ -n "$PARTS" ]; then  # wheels carried in parts: joined and checked, then installed as below
  if bash "$REPO/scripts/wheel_parts.sh" join "$PARTS" "$WORK/joined" >&2; then
    for w in "$WORK"/joined/*.whl; do  # split refuses two versions of one wheel
      case "${w##*/}" in
        onnxruntime_gpu-*)
          if [ -n "$ORT_WHEEL" ]; then log "--ort-wheel $ORT_WHEEL given: ${w##*/} from the parts is not installed"
          else ORT_WHEEL=$w; fi ;;
        *) PART_WHEELS+=("$w") ;;
      esac
    done
  else
    log "joining the wheel parts in $PARTS failed (above); going on with what is installed"
  fi
fi
[ -z "$WHEELS" ] || PART_WHEELS+=("$WHEELS"/*.whl)
if [ ${#PART_WHEELS[@]} -gt 0 ]; then
  install_wheels "$WORK/site" "${PART_WHEELS[@]}" || log "installing the wheels ${PART_WHEELS[*]##*/} failed"
fi
if [ -n "$ORT_WHEEL" ]; then
  install_wheels "$WORK/ort" "$ORT_WHEEL" && link_nvidia "$WORK/ort" || log "installing $ORT_WHEEL failed"
fi

# ---- helper: figures and the report (python, stdlib only, torch for the checkpoint's plan) ----------
HELPER="$WORK/helper.py"
cat >"$HELPER" <<'PYEOF'
import json, re, sys, time
from pathlib import Path

def units(s):
    m = re.match(r"([0-9.]+) (GiB|MiB|KiB|B)", s)
    return int(float(m.group(1)) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[m.group(2)]) if m else None

def parse_budget(s):
    m = re.fullmatch(r"([0-9.]+)\s*([A-Za-z]+)", s.strip())
    u = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}[m.group(2).lower()]
    return int(float(m.group(1)) * u)

def plan_figures(log):
    """The plan table's lines: plan and estimated peaks."""
    text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    out = {}
    m = re.search(r"^plan: (.*)$", text, re.M)
    if m:
        out["plan"] = m.group(1)
    m = re.search(r"^estimated peak: training ([0-9.]+ \w+), validation ([0-9.]+ \w+)", text, re.M)
    if m:
        out["estimate_train_bytes"], out["estimate_val_bytes"] = units(m.group(1)), units(m.group(2))
    m = re.search(r"planned in ([0-9.]+) s", text)
    if m:
        out["plan_seconds"] = float(m.group(1))
    out["oom_fallbacks"] = text.count("out of memory: micro-batch halved")
    return out

def cmd_train(name, metrics, log, budget):
    recs = [json.loads(l) for l in Path(metrics).read_text().splitlines() if l.strip()]
    b = parse_budget(budget)
    fig = {"part": name, **plan_figures(log)}
    fig["epochs"] = len(recs)
    fig["peak_train_bytes"] = max(r["peak_memory"]["train"]["bytes"] for r in recs)
    fig["peak_val_bytes"] = max(r["peak_memory"]["val"]["bytes"] for r in recs)
    fig["peak_kind"] = recs[-1]["peak_memory"]["train"]["kind"]
    fig["windows_per_second"] = recs[-1]["windows_per_second"]
    fig["train_seconds"] = recs[-1]["train_seconds"]
    fig["micro_batch"] = recs[-1]["micro_batch"]
    fig["budget_bytes"] = b
    fig["within_budget"] = max(fig["peak_train_bytes"], fig["peak_val_bytes"]) <= b
    print(json.dumps(fig))

def cmd_plan(name, log):
    print(json.dumps({"part": name, **plan_figures(log)}))

def cmd_util(name, csv):
    rows = []
    for line in Path(csv).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[1]), float(parts[2])))
        except (IndexError, ValueError):
            pass
    busy = [u for u, _ in rows if u > 5]
    print(json.dumps({"part": name, "samples": len(rows),
                      "util_mean": sum(u for u, _ in rows) / len(rows) if rows else None,
                      "util_mean_busy": sum(busy) / len(busy) if busy else None,
                      "util_max": max((u for u, _ in rows), default=None),
                      "memory_used_max_mib": max((m for _, m in rows), default=None),
                      "note": "memory.used is the whole process on the card (CUDA context included), "
                              "not the allocated memory the budget caps"}))

def cmd_describe(figures, part):
    figs = {f["part"]: f for f in map(json.loads, Path(figures).read_text().splitlines())}
    f = figs[part]
    text = (f"peak train {f['peak_train_bytes'] / 2**30:.2f} GiB, validation {f['peak_val_bytes'] / 2**30:.2f} GiB "
            f"({f['peak_kind']}), {f['windows_per_second']:.1f} windows/s, micro-batch {f['micro_batch']}, "
            f"out-of-memory fallbacks {f['oom_fallbacks']}")
    if part == "train_cuda":
        util = figs.get("gpu_util", {})
        text = (("within" if f["within_budget"] else "OVER") + f" the {f['budget_bytes'] / 2**30:.2f} GiB budget: "
                + text + f"; GPU utilisation mean {util.get('util_mean')}%, while busy {util.get('util_mean_busy')}%")
    print(text)

def cmd_report(results, figures, out, header):
    parts = []
    for line in Path(results).read_text().splitlines():
        name, status, seconds, detail = (line.split("\t") + ["", "", ""])[:4]
        parts.append({"part": name, "status": status, "seconds": float(seconds or 0), "detail": detail})
    figs = [json.loads(l) for l in Path(figures).read_text().splitlines() if l.strip()]
    hdr = json.loads(Path(header).read_text())
    by = {f["part"]: f for f in figs}
    cuda, cpu, plan_cpu = by.get("train_cuda", {}), by.get("train_cpu", {}), by.get("plan_cpu", {})
    summary = {}
    if cuda.get("peak_train_bytes"):
        peak = max(cuda["peak_train_bytes"], cuda["peak_val_bytes"])
        summary["measured_peak_bytes"] = peak
        summary["budget_bytes"] = cuda["budget_bytes"]
        for src, f in (("cuda_plan", cuda), ("cpu_plan", plan_cpu)):
            if f.get("estimate_train_bytes"):
                est = max(f["estimate_train_bytes"], f["estimate_val_bytes"])
                summary[f"{src}_estimate_bytes"] = est
                summary[f"{src}_estimate_over_measured"] = round(est / peak, 3)
        if cpu.get("windows_per_second"):
            summary["cuda_over_cpu_throughput"] = round(cuda["windows_per_second"] / cpu["windows_per_second"], 1)
    report = {**hdr, "parts": parts, "figures": figs, "summary": summary}
    Path(out, "report.json").write_text(json.dumps(report, indent=2) + "\n")
    gib = lambda n: f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) else "-"
    md = [f"# GPU check, {hdr['date']}", "", f"- machine: {hdr['machine']}", f"- GPU: {hdr['gpu'] or 'none'}",
          f"- torch {hdr['torch']}, onnxruntime {hdr['onnxruntime']} (providers: {hdr['ort_providers']})",
          f"- budget {hdr['budget']}, {hdr['steps']} CUDA steps", "", "| part | status | seconds | detail |",
          "| --- | --- | --- | --- |"]
    md += [f"| {p['part']} | {p['status']} | {p['seconds']:.0f} | {p['detail'].replace('|', '/')} |" for p in parts]
    if summary:
        md += ["", "## Figures", ""]
        if "measured_peak_bytes" in summary:
            md.append(f"- measured peak (max of train and validation, allocated): {gib(summary['measured_peak_bytes'])} "
                      f"of a {gib(summary['budget_bytes'])} budget")
        for src in ("cuda_plan", "cpu_plan"):
            if f"{src}_estimate_bytes" in summary:
                md.append(f"- {src.replace('_', ' ')} estimate {gib(summary[src + '_estimate_bytes'])}: "
                          f"{summary[src + '_estimate_over_measured']} x the measured peak")
        if "cuda_over_cpu_throughput" in summary:
            md.append(f"- training throughput: CUDA {cuda['windows_per_second']:.0f} windows/s, CPU "
                      f"{cpu['windows_per_second']:.1f} windows/s ({summary['cuda_over_cpu_throughput']} x)")
    if figs:
        md += ["", "## Raw figures", "", "```json", *[json.dumps(f) for f in figs], "```"]
    Path(out, "report.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))

if __name__ == "__main__":
    globals()["cmd_" + sys.argv[1]](*sys.argv[2:])
PYEOF

# ---- env ------------------------------------------------------------------------------------
GPU=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)
fi
TORCH_INFO=$("$PY" -c "import torch; print(torch.__version__, 'cuda' if torch.cuda.is_available() else 'no-cuda')" 2>&1 | tail -1)
TORCH_CUDA=0
case "$TORCH_INFO" in *" cuda") TORCH_CUDA=1 ;; esac
ORT_VERSION=$("$PY" -c "import onnxruntime as o; print(o.__version__)" 2>/dev/null || echo "not installed")
ORT_PROVIDERS=$("$PY" -c "import onnxruntime as o; print(','.join(o.get_available_providers()))" 2>/dev/null || echo "")
ORT_FROM=$("$PY" -c "import onnxruntime as o, os; print(os.path.dirname(o.__file__))" 2>/dev/null || echo "")
"$PY" - "$WORK/header.json" "$GPU" "$TORCH_INFO" "$ORT_VERSION${ORT_FROM:+ from $ORT_FROM}" "$ORT_PROVIDERS" "$BUDGET" \
  "$STEPS" <<'PYEOF'
import json, platform, sys, datetime, os
path, gpu, torch_info, ort, providers, budget, steps = sys.argv[1:]
json.dump({"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.node()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
           "gpu": gpu, "torch": torch_info, "onnxruntime": ort, "ort_providers": providers,
           "budget": budget, "steps": int(steps)}, open(path, "w"))
PYEOF
if [ -n "$GPU" ] && [ "$TORCH_CUDA" = 1 ]; then
  record env pass 0 "GPU $GPU; torch $TORCH_INFO; onnxruntime $ORT_VERSION ($ORT_PROVIDERS)"
elif [ -n "$GPU" ]; then
  record env fail 0 "nvidia-smi sees $GPU but torch has no CUDA ($TORCH_INFO): the CUDA parts cannot run"
else
  record env skipped 0 "no GPU on this machine (nvidia-smi absent or sees none): running what the CPU can"
fi
HAVE_CUDA=0
[ -n "$GPU" ] && [ "$TORCH_CUDA" = 1 ] && HAVE_CUDA=1

# ---- data -----------------------------------------------------------------------------------
DATA="$WORK/wide.parquet"
t0=$SECONDS
if "$PY" -m features.synth --help 2>/dev/null | grep -q -- --extra-features; then
  "$PY" -m features.synth --out "$DATA" --bars "$BARS" --extra-features 220 2>"$WORK/data.log"
else
  "$PY" - "$DATA" "$BARS" 2>"$WORK/data.log" <<'PYEOF'
import sys, numpy as np, pyarrow as pa, pyarrow.parquet as pq
from features.synth import generate
t = generate(["ES", "NQ"], int(sys.argv[2]), seed=7)
rng = np.random.default_rng(0)
for i in range(220):
    t = t.append_column(f"f{i:03d}", pa.array(rng.standard_normal(t.num_rows).cumsum()))
pq.write_table(t, sys.argv[1])
PYEOF
fi
if [ -f "$DATA" ]; then
  record data pass $((SECONDS - t0)) "2 symbols x $BARS bars with user columns f000..f219"
else
  record data fail $((SECONDS - t0)) "could not write sample bars: $(tail_of "$WORK/data.log")"
fi
PRESET=(--config presets/production.toml --parquet "$DATA")

# ---- plan_cpu ------------------------------------------------------------------------------------
if [ -f "$DATA" ] && time_left; then
  t0=$SECONDS
  CUDA_VISIBLE_DEVICES="" timeout 240 "$PY" -m trainer "${PRESET[@]}" --device cuda --vram-budget "$BUDGET" \
    --plan-only >"$OUT/plan_cpu.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    "$PY" "$HELPER" plan plan_cpu "$OUT/plan_cpu.log" >>"$FIGURES"
    record plan_cpu pass $((SECONDS - t0)) "$(grep -m1 '^plan:' "$OUT/plan_cpu.log") ($(grep -m1 '^estimated peak' "$OUT/plan_cpu.log"))"
  else
    record plan_cpu fail $((SECONDS - t0)) "exit $rc: $(tail_of "$OUT/plan_cpu.log")"
  fi
else
  record plan_cpu skipped 0 "no data or out of time"
fi

# ---- train_cuda ----------------------------------------------------------------------------------
CKPT_CUDA="$WORK/cuda/ckpt.pt"
if [ $HAVE_CUDA = 1 ] && [ -f "$DATA" ] && time_left; then
  t0=$SECONDS
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 200 \
    >"$OUT/gpu_util.csv" 2>/dev/null &
  SMI_PID=$!
  timeout 300 "$PY" -m trainer "${PRESET[@]}" --out "$CKPT_CUDA" --device cuda --vram-budget "$BUDGET" --epochs 1 \
    --max-steps-per-epoch "$STEPS" --max-val-windows 512 --no-progress --no-report >"$OUT/train_cuda.log" 2>&1
  rc=$?
  kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null
  if [ $rc = 0 ] && [ -f "${CKPT_CUDA%.pt}.metrics.jsonl" ]; then
    "$PY" "$HELPER" util gpu_util "$OUT/gpu_util.csv" >>"$FIGURES"
    "$PY" "$HELPER" train train_cuda "${CKPT_CUDA%.pt}.metrics.jsonl" "$OUT/train_cuda.log" "$BUDGET" >>"$FIGURES"
    detail=$("$PY" "$HELPER" describe "$FIGURES" train_cuda)
    case "$detail" in
      within*) record train_cuda pass $((SECONDS - t0)) "$detail" ;;
      *) record train_cuda fail $((SECONDS - t0)) "$detail" ;;
    esac
  else
    record train_cuda fail $((SECONDS - t0)) "exit $rc: $(tail_of "$OUT/train_cuda.log")"
  fi
elif [ $HAVE_CUDA = 0 ]; then
  record train_cuda skipped 0 "no GPU"
else
  record train_cuda skipped 0 "no data or out of time"
fi

# ---- train_cpu -----------------------------------------------------------------------------------
CKPT_CPU="$WORK/cpu/ckpt.pt"
if [ -f "$DATA" ] && time_left; then
  t0=$SECONDS
  if [ $HAVE_CUDA = 1 ]; then  # the same preset on every CPU thread, a few steps of 8 windows
    # (the CUDA plan's micro-batch is about that size; a CPU step of 128 windows needs tens of GB)
    CPU_FLAGS=("${PRESET[@]}" --batch-size 8 --max-steps-per-epoch "$CPU_STEPS" --max-val-windows 16
               --threads "$NPROC")
    what="the preset on $NPROC CPU threads, $CPU_STEPS steps of 8 windows"
  else  # no GPU: a tiny run that shows the pipeline works (the preset takes minutes per step here)
    CPU_FLAGS=(--parquet "$DATA" --hidden-size 16 --attention-heads 2 --encoder-length 30 --batch-size 32
               --max-steps-per-epoch 5 --max-val-windows 128 --threads "$NPROC")
    what="no GPU: a tiny model on $NPROC CPU threads (not the preset)"
  fi
  timeout 240 "$PY" -m trainer "${CPU_FLAGS[@]}" --out "$CKPT_CPU" --device cpu --vram-budget "$BUDGET" --epochs 1 \
    --no-progress --no-report >"$OUT/train_cpu.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    "$PY" "$HELPER" train train_cpu "${CKPT_CPU%.pt}.metrics.jsonl" "$OUT/train_cpu.log" "$BUDGET" >>"$FIGURES"
    na=$(grep -c "not applicable on the CPU" "$OUT/train_cpu.log")
    record train_cpu pass $((SECONDS - t0)) "$what: $("$PY" "$HELPER" describe "$FIGURES" train_cpu); budget reported not applicable: $([ "$na" -gt 0 ] && echo yes || echo NO)"
  else
    record train_cpu fail $((SECONDS - t0)) "exit $rc: $(tail_of "$OUT/train_cpu.log")"
  fi
else
  record train_cpu skipped 0 "no data or out of time"
fi

# ---- export (placement gate) and serving ---------------------------------------------------------------
MODEL="$WORK/model.onnx"
: >"$OUT/export_serving.log"
ORT_CUDA=0
case ",$ORT_PROVIDERS," in *,CUDAExecutionProvider,*) ORT_CUDA=1 ;; esac
if [ ! -f export/__main__.py ]; then
  record export skipped 0 "python -m export does not exist yet"
elif [ $HAVE_CUDA = 0 ]; then
  record export skipped 0 "no GPU"
elif [ $ORT_CUDA = 0 ]; then
  record export skipped 0 "onnxruntime $ORT_VERSION here has no CUDAExecutionProvider (providers: $ORT_PROVIDERS); pass --ort-wheel PATH to an onnxruntime-gpu wheel"
elif [ ! -f "$CKPT_CUDA" ]; then
  record export skipped 0 "no CUDA checkpoint (train_cuda did not finish)"
elif ! time_left; then
  record export skipped 0 "out of time"
else
  t0=$SECONDS
  timeout 240 "$PY" -m export "$CKPT_CUDA" "$MODEL" --require-device cuda --threads "$NPROC" \
    >>"$OUT/export_serving.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    record export pass $((SECONDS - t0)) "placement gate passed on CUDAExecutionProvider: $(grep -i -m2 'placement\|nodes' "$OUT/export_serving.log" | tr '\n' ' ')"
  else
    record export fail $((SECONDS - t0)) "exit $rc: $(tail_of "$OUT/export_serving.log")"
  fi
fi

SERVING_OK=1
if [ ! -f serving/__main__.py ] || [ ! -f benchmarks/serving_load.py ]; then
  SERVING_OK=0; why="python -m serving or benchmarks/serving_load.py does not exist yet"
elif ! "$PY" -c "import grpc, grpc_health.v1, grpc_reflection.v1alpha, grpc_status, google.rpc.error_details_pb2, psutil" 2>>"$OUT/export_serving.log"; then
  SERVING_OK=0; why="the server's packages are missing here (grpcio-health-checking, grpcio-reflection, grpcio-status, googleapis-common-protos, psutil): pass --wheels DIR"
fi
LOOP_ARGS=()  # uvloop, the server's default loop, is 4.3 MiB more to carry: without it, asyncio's loop, said so
if [ $SERVING_OK = 1 ] && ! "$PY" -c "import uvloop" 2>/dev/null; then
  LOOP_ARGS=(--server-arg=--event-loop=asyncio)
  log "uvloop is not installed here: the servers run on asyncio's own loop (--event-loop asyncio; about 10% more server CPU per call at 64 clients on the 2-vCPU machine, BENCHMARKS.md)"
fi
# serving_load starts the server itself (python -m serving on 127.0.0.1, metrics scraped for the batch
# sizes), measures bare ONNX Runtime on the same provider, then 1, 8 and 64 closed-loop clients (the first
# part of each device also one client paced at 20 calls a second: a caller once a bar, on cold caches)
serving_load() {  # serving_load PART MODEL DEVICE WHAT CHANNELS CLIENT_FLAGS [SERVER_ARG...]
  local part=$1 model=$2 device=$3 what=$4 channels=$5 t0=$SECONDS rc
  local -a extra
  [ ${#LOOP_ARGS[@]} = 0 ] || what="$what; asyncio's event loop (no uvloop here)"
  read -r -a extra <<<"$6"  # serving_load's own flags, e.g. --packed
  shift 6
  for a in "$@"; do extra+=("--server-arg=$a"); done
  echo "== $part: $what" >>"$OUT/export_serving.log"
  timeout 200 "$PY" -m benchmarks.serving_load --model "$model" --parquet "$DATA" --device "$device" \
    --concurrency 1,8,64 --duration 5 --client-procs 4 --channels "$channels" --server-arg=--max-batch=64 \
    ${LOOP_ARGS[@]+"${LOOP_ARGS[@]}"} "${extra[@]}" \
    --json "$WORK/$part.json" >>"$OUT/export_serving.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    "$PY" -c "import json,sys; print(json.dumps({'part': sys.argv[2], 'what': sys.argv[3], **json.load(open(sys.argv[1]))}))" \
      "$WORK/$part.json" "$part" "$what" >>"$FIGURES" 2>/dev/null
    record "$part" pass $((SECONDS - t0)) "$what: $("$PY" -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; print(', '.join(f'{k} {v}' for k, v in s.items()))" "$WORK/$part.json")"
  else
    record "$part" fail $((SECONDS - t0)) "serving_load exit $rc: $(tail_of "$OUT/export_serving.log")"
  fi
}

if [ $SERVING_OK = 0 ]; then
  for part in serving serving_packed serving_workers; do record $part skipped 0 "$why"; done
elif [ ! -f "$MODEL" ]; then
  for part in serving serving_packed serving_workers; do
    record $part skipped 0 "no exported CUDA model (see export)"
  done
elif ! time_for 90; then
  for part in serving serving_packed serving_workers; do record $part skipped 0 "out of time"; done
else
  serving_load serving "$MODEL" cuda "the preset model on the CUDA provider" 1 "--rate 20"
  # the floor rows measure the machine: `serving` has them, the variants skip them (time)
  if time_for 90; then  # and each level again on PredictStream, one open stream per client
    serving_load serving_packed "$MODEL" cuda "the preset model on the CUDA provider, user columns packed" 1 \
      "--packed --no-floor --stream"
  else
    record serving_packed skipped 0 "out of time"
  fi
  if time_for 70; then
    serving_load serving_workers "$MODEL" cuda "the preset model on the CUDA provider, 4 server processes, packed" \
      8 "--packed --no-floor" --workers=4
  else
    record serving_workers skipped 0 "out of time"
  fi
fi

# ---- gpu_tests: the suite's own GPU tests ------------------------------------------------------------------
if [ $HAVE_CUDA = 0 ]; then
  record gpu_tests skipped 0 "no GPU"
elif [ $ORT_CUDA = 0 ]; then
  record gpu_tests skipped 0 "onnxruntime $ORT_VERSION here has no CUDAExecutionProvider"
elif ! "$PY" -c "import pytest" 2>/dev/null; then
  record gpu_tests skipped 0 "pytest is not installed for $PY"
elif ! time_for 90; then
  record gpu_tests skipped 0 "out of time"
else
  t0=$SECONDS
  limit=$((DEADLINE_S - SECONDS + 60))  # ends by a minute past the deadline, so the report is still written
  [ "$limit" -le 240 ] || limit=240
  timeout "$limit" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_export.py tests/test_planner.py \
    >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  summary=$(grep -E '[0-9]+ (passed|failed|skipped|errors?)' "$OUT/gpu_tests.log" | tail -1)  # pytest's last line
  if [ $rc = 0 ] && ! grep -q "skipped" <<<"$summary"; then
    record gpu_tests pass $((SECONDS - t0)) "pytest -m gpu: $summary"
  else
    record gpu_tests fail $((SECONDS - t0)) "pytest -m gpu exit $rc: ${summary:-$(tail_of "$OUT/gpu_tests.log")}"
  fi
fi

# ---- serving_cpu: the small test model on the CPU provider of this (uncontended) machine ------------------
TINY="$WORK/tiny"
if [ $SERVING_OK = 0 ]; then
  for part in serving_cpu serving_cpu_pinned; do record $part skipped 0 "$why"; done
elif [ ! -f "$DATA" ] || ! time_for 90; then
  for part in serving_cpu serving_cpu_pinned; do
    record $part skipped 0 "no data or out of time"
  done
else
  t0=$SECONDS
  mkdir -p "$TINY"
  if timeout 120 "$PY" -m trainer --parquet "$DATA" --out "$TINY/ckpt.pt" --hidden-size 8 --attention-heads 2 \
       --encoder-length 20 --horizon 3 --batch-size 32 --epochs 1 --max-steps-per-epoch 5 --max-val-windows 200 \
       --threads 1 --device cpu --no-progress --no-report >>"$OUT/export_serving.log" 2>&1 \
     && timeout 120 "$PY" -m export "$TINY/ckpt.pt" "$TINY/model.onnx" --threads 1 >>"$OUT/export_serving.log" 2>&1; then
    serving_load serving_cpu "$TINY/model.onnx" cpu "the tiny test model (hidden 8, encoder 20) on the CPU provider, 1 thread" 1 \
      "--rate 20 --stream"
    if time_for 60 && [ "$(nproc)" -ge 4 ]; then  # the server's threads on two CPUs (the 3rd and 4th this
      # process may use: the first often serves interrupts), the clients anywhere
      pin=$("$PY" -c "import os; c = sorted(os.sched_getaffinity(0)); print(f'{c[2]},{c[3]}')")
      serving_load serving_cpu_pinned "$TINY/model.onnx" cpu "serving_cpu with the server on CPUs $pin only" 1 \
        "--no-floor --server-cpus $pin"
    else
      record serving_cpu_pinned skipped 0 "out of time, or fewer than 4 CPUs"
    fi
  else
    record serving_cpu fail $((SECONDS - t0)) "the tiny model could not be trained or exported: $(tail_of "$OUT/export_serving.log")"
    record serving_cpu_pinned skipped 0 "no tiny model (see serving_cpu)"
  fi
fi

# ---- the report ---------------------------------------------------------------------------------
"$PY" "$HELPER" report "$RESULTS" "$FIGURES" "$OUT" "$WORK/header.json" || log "writing the report failed"
status=0
grep -q $'\tfail\t' "$RESULTS" && status=1
rm -rf "$WORK"
exit $status
