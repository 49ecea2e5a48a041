#!/usr/bin/env bash
# One GPU lease's checks in one command, in priority order, each part time-boxed so a failure
# or a hang costs that part alone; every figure lands under $OUT (default /tmp/gpu_lease).
#
#   LEASE_S=560 bash benchmarks/gpu_lease.sh [PART ...]  # parts: env kernels tests simulated titan moe moe_f8 heldout
# TITAN_ARGS: more arguments of torchtitan_pair.py (--profile: one step's kernels of each)
#
# LEASE_S bounds the whole command: a part's limit is cut to what is left of it, so the last
# part (heldout, whose rows are written as each job ends) gets the rest.
# Needs the wheels the GPU image lacks in .whl/ (Hydra, OmegaConf, antlr4, torchao; see
# docs/gpu.md, "Running the checks on a lent GPU") and, for the torchtitan pair, .whl_titan/.
set -u
OUT=${OUT:-/tmp/gpu_lease}
mkdir -p "$OUT"
PARTS=${*:-env kernels tests titan moe moe_f8 heldout}
LEASE_S=${LEASE_S:-560}
LOG="$OUT/all.log"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 || echo "wheel install failed (see all.log)"
  export PYTHONPATH="/tmp/site:$PWD"
fi

part() {  # part NAME SECONDS COMMAND...: run, time-boxed, its output to all.log and the console tail
  local name=$1 limit=$2
  shift 2
  local left=$((LEASE_S - SECONDS))
  if ((left < 20)); then
    echo "== $name skipped: ${left}s of the lease left" | tee -a "$LOG"
    return
  fi
  ((limit > left)) && limit=$left
  local start=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $((SECONDS - start))s" | tee -a "$LOG"
}

for p in $PARTS; do
  case $p in
    env)
      {
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        python3 -c "import sys, torch, torchao, hydra; import torch.nn.functional as F
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'torchao', torchao.__version__, 'hydra', hydra.__version__,
      'F.grouped_mm', hasattr(F, 'grouped_mm'), 'cap', torch.cuda.get_device_capability())"
      } >"$OUT/env.txt" 2>&1
      cat "$OUT/env.txt" ;;
    kernels) part kernels 80 python3 benchmarks/gpu_kernels.py --json "$OUT/kernels.json" ;;
    tests)
      part tests 45 python3 -m pytest -q -p no:cacheprovider tests/test_common_layers.py \
        tests/test_step_loop.py::test_cuda_steps_make_no_synchronizing_call ;;
    simulated)  # the tests that simulate a GPU node: they must not depend on the real one
      part simulated 45 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_devices.py \
        tests/test_gpu_launch.py ;;
    moe) part moe 40 python3 benchmarks/moe_gpu.py --part matmul ;;
    moe_f8)
      part moe_f8 100 python3 benchmarks/moe_gpu.py --part float8 --tokens 8192 --repeats 10 \
        --warmup 3 --steps 8 --step-warmup 3 ;;
    heldout)
      part heldout 300 python3 benchmarks/planner_gpu_heldout.py run --steps 14 \
        --timeout-s 100 --json "$OUT/heldout.json" ;;
    titan)
      if ls .whl_titan/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /tmp/titan .whl_titan/*.whl >>"$LOG" 2>&1
        part titan 120 python3 benchmarks/torchtitan_pair.py --compile off --steps 16 \
          --timeout 100 --out "$OUT/titan.json" ${TITAN_ARGS:-}
      else
        echo "== titan skipped: no .whl_titan/" | tee -a "$LOG"
      fi ;;
    *) echo "unknown part $p" ;;
  esac
done
grep -E "^== |rc=" "$LOG" | tail -n 20
