#!/usr/bin/env bash
# The GPU check of docs/accelerator.md, for a machine with one CUDA GPU: it needs only this repo and pip, and takes
# under 8 minutes. It runs, each step on its own (a failing step does not stop the rest):
#   1. the device kernel's test and the shipped model's replies against the CPU's;
#   2. family parity against transformers and the lanes identity tests, on the device (MOELANE_TEST_DEVICE);
#   3. bench/decode_bench.py on the device: moelane (eager and compiled) against transformers, batch 1, on the
#      random 115M model (float32; also compiled with CUDA graphs, its tokens compared) and on the inflated model
#      (bench/inflate.py, bf16 and int8);
#   4. the inflated model paged: device pools of 50% and 25% of its expert bytes, with pinned host RAM behind them,
#      then 25% from disk alone;
# then prints one summary table. Logs and JSON lines go to OUT_DIR (default /tmp/moelane-device-check).
#
#   bash bench/device_check.sh [OUT_DIR]
#
# Dependencies: moelane with its test extras (`pip install -e '.[dev]'`, done here if `import moelane` fails).
# Environment: PYTHON (default python3), DEVICE (default cuda), STEP_TIMEOUT (seconds a step, default 240).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-/tmp/moelane-device-check}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! $PY -c "import moelane, transformers, pytest" 2>/dev/null; then
    $PY -m pip install -q -e '.[dev]' || { echo "device_check: installing moelane failed" >&2; exit 1; }
fi
$PY - <<'EOF' | tee "$OUT_DIR/machine.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, round(p.total_memory / 2**30, 1), "GiB,", p.multi_processor_count, "SMs")
EOF

step() {  # step NAME COMMAND...: run with a timeout, log to OUT_DIR/NAME.log, record the exit status
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name: $*"
    timeout "$STEP_TIMEOUT" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - t0))" >>"$OUT_DIR/steps.txt"
    tail -n 4 "$OUT_DIR/$name.log"
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
}

: >"$OUT_DIR/steps.txt"
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 6")  # (pytest-xdist where installed: the GPU has room)
step kernel $PY -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_kernel.py tests/test_device.py \
    $(ls tests/pager/test_store_device.py 2>/dev/null)
step parity env MOELANE_TEST_DEVICE=$DEVICE $PY -m pytest -q -p no:cacheprovider $XDIST --maxfail=30 \
    tests/model/test_families.py -k "test_fp32_matches_transformers or test_bf16_greedy_matches_transformers"
step identity env MOELANE_TEST_DEVICE=$DEVICE $PY -m pytest -q -p no:cacheprovider $XDIST --maxfail=30 \
    tests/lanes/test_engine_lm.py
SMALL=$OUT_DIR/qwen3moe-115m
INFLATED=$OUT_DIR/inflated-8192
step decode-115m $PY bench/decode_bench.py --model "$SMALL" --quant float32 --device "$DEVICE" \
    --engines moelane,moelane-compiled,transformers --cuda-graphs --rounds 3 --tokens 64
[ -f "$INFLATED/config.json" ] || step inflate $PY bench/inflate.py "$INFLATED"
step decode-inflated $PY bench/decode_bench.py --model "$INFLATED" --quant bf16,int8 --device "$DEVICE" \
    --engines moelane,moelane-compiled,transformers --rounds 3 --tokens 64
for budget in 50 25; do
    step "paged-$budget-host" $PY bench/decode_bench.py --model "$INFLATED" --quant bf16 --device "$DEVICE" \
        --engines moelane --expert-memory "$budget%" --host-memory 100% --rounds 3 --tokens 64
done
step paged-25-disk $PY bench/decode_bench.py --model "$INFLATED" --quant bf16 --device "$DEVICE" \
    --engines moelane --expert-memory 25% --rounds 3 --tokens 64

$PY - "$OUT_DIR" <<'EOF' | tee "$OUT_DIR/summary.txt"
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print("\nstep                 exit  seconds")
for line in (out / "steps.txt").read_text().splitlines():
    name, rc, secs = line.split()
    print(f"{name:<20}{rc:>6}{secs:>9}")
print(f"\n{'run':<20}{'quant':<8}{'moelane':>9}{'compiled':>10}{'graphs':>8}{'transformers':>14}{'ratio':>7}"
      f"{'hit rate':>10}")
resident = {}
for log in sorted(out.glob("*.log")):
    lines = [json.loads(t) for t in log.read_text().splitlines() if t.startswith("{")]
    hits = {r["quant"]: r["hit_rate"] for r in lines if "hit_rate" in r}
    for s in (r for r in lines if r.get("summary")):
        m = s["median_tok_s"]
        best = max((v for k, v in m.items() if k.startswith("moelane")), default=None)
        if log.stem == "decode-inflated":
            resident[s["quant"]] = best
        cells = [f"{m[k]:.1f}" if k in m else "-" for k in ("moelane", "moelane-compiled", "moelane-graphs",
                                                             "transformers")]
        if "graphs_same_tokens_as_compiled" in s:
            cells[2] += "" if s["graphs_same_tokens_as_compiled"] else "*"
        ratio = s.get("moelane_vs_transformers")
        if ratio is None and log.stem.startswith("paged") and resident.get(s["quant"]):
            ratio = f"{best / resident[s['quant']]:.2f}r"  # (of the all-resident run)
        hit = hits.get(s["quant"], "-")
        print(f"{log.stem:<20}{s['quant']:<8}{cells[0]:>9}{cells[1]:>10}{cells[2]:>8}{cells[3]:>14}{ratio or '-':>7}"
              f"{hit:>10}")
print("(ratio: moelane's best against transformers; 'r': a paged run against the all-resident one; graphs: compiled "
      "with CUDA graphs, '*' where its tokens differ from compiled's)")
EOF
