#!/usr/bin/env bash
# The GPU check (docs/float8.md, "The GPU check"): on a machine with one NVIDIA GPU, in under 8 minutes,
#   0. every layout (ddp_overlap, zero1-3, HSDP, tp+SP, pp with three schedules, cp ring / all-to-all, ep) for two
#      optimizer steps with two ranks (four for HSDP) on the one GPU, under the backend map cuda:gloo (NCCL refuses two
#      ranks on one device; a map without a cpu entry keeps NCCL's device rule), one launch per layout with a time
#      limit, the table written to ${OUT%.md}.layouts.md (lightning_par/benchmarks/gpu_check.py --layouts);
#   1. the host synchronisations of one training step of every layout (tests/profiling/test_host_syncs_gpu.py: the same two
#      ranks on the one GPU under cuda:gloo, torch.cuda.set_sync_debug_mode("warn"), each synchronisation attributed to
#      a function of the package and checked against docs/host-syncs.md), the table written to ${OUT%.md}.host-syncs.md;
#   2. the throughput table: tokens/s, MFU and peak memory of a ~1B Llama-shaped model, bf16, seq 2048, eager /
#      per-block compiled / compiled + float8, under Lightning's plain single-device strategy and lightning_par's zero3
#      at world 1 (lightning_par/benchmarks/gpu_check.py), written to $OUT (default gpu_check.md), then the MoE row:
#      one MoE block at 64 experts in bf16, torch._grouped_mm vs the per-expert loop;
#   3. the other tests with a CUDA path (marker gpu: nccl at world 1, float8 on CUDA), with
#      LP_REQUIRE_CUDA=1 so that a test skipped for want of CUDA fails instead.
# On a machine without a CUDA device it fails at once (exit 2). `scripts/gpu_check.sh --dry-run` runs every piece of
# step 2 on the CPU with a tiny model, runs steps 0 and 1 on the CPU (gloo, every rank on the CPU; step 1 then counts
# nothing: it checks the path) and only collects the tests of steps 1 and 3 (what CI checks). Each part has a time
# limit (90 + 90 + 235 + 60 s, within 8 minutes), so a hang costs that part, not the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${OUT:-gpu_check.md}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=0
for arg in "$@"; do [[ "$arg" == "--dry-run" ]] && DRY=1; done
if [[ $DRY == 0 ]]; then
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: FAILED: no CUDA device is visible to torch on $(hostname) (torch.cuda.is_available() is False)." >&2
    echo "gpu_check: run it on a machine with one NVIDIA GPU, or use --dry-run to check the script on the CPU." >&2
    exit 2
  fi
fi
start=$(date +%s)
status=0
LAYOUTS_OUT="${OUT%.md}.layouts.md"
SYNCS_OUT="${OUT%.md}.host-syncs.md"
part() {  # part NAME COMMAND...: run it, report its time and status (a failed part does not stop the others)
  local name=$1 begin rc=0
  shift
  begin=$(date +%s)
  "$@" || rc=$?
  echo "gpu_check: part $name: $(( $(date +%s) - begin )) s, exit status $rc"
  [[ $rc == 0 ]] || status=$rc
}
part layouts timeout 90 "$PY" -m lightning_par.benchmarks.gpu_check --layouts --layout-timeout-s 25 \
  --out "$LAYOUTS_OUT" "$@"
if [[ $DRY == 1 ]]; then
  part host-syncs timeout 90 "$PY" -m lightning_par.benchmarks.gpu_check --host-syncs --dry-run --out "$SYNCS_OUT"
else
  part host-syncs env LP_REQUIRE_CUDA=1 LP_HOST_SYNCS_OUT="$SYNCS_OUT" timeout 90 "$PY" -m pytest -q \
    -p no:cacheprovider tests/profiling/test_host_syncs_gpu.py
fi
part throughput timeout 235 "$PY" -m lightning_par.benchmarks.gpu_check --out "$OUT" "$@"
if [[ $DRY == 1 ]]; then
  part tests timeout 60 "$PY" -m pytest -qq --collect-only -p no:cacheprovider -m "gpu and not slow" tests
else
  part tests env LP_REQUIRE_CUDA=1 timeout 60 "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests \
    --ignore=tests/profiling/test_host_syncs_gpu.py
fi
echo
cat "$LAYOUTS_OUT" 2>/dev/null || echo "gpu_check: no layout table ($LAYOUTS_OUT): the part timed out or failed to start"
echo
cat "$SYNCS_OUT" 2>/dev/null || echo "gpu_check: no host-sync table ($SYNCS_OUT): the part timed out or failed to start"
echo "gpu_check: tables in $LAYOUTS_OUT, $SYNCS_OUT and $OUT; $(( $(date +%s) - start )) s; exit status $status"
exit $status
