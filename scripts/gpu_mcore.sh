#!/usr/bin/env bash
# megatron-core's own models (family mcore) on a GPU box where TransformerEngine and megatron-core
# import (docs/megatron-core.md says how to install both). In order, each section with its own time limit
# so one slow part cannot eat the others' output:
#   seed        the seed case through `offload-harness run` with megatron-core's offloader
#   seed-delays the same with race-provocation delays on its streams (mcore+delays)
#   cases       every mcore row, every case file (pytest cases/ --family mcore)
#   moe-delays  the MoE rows (both expert paths) under delays
#   bridge      the mcore rows with the harness's reference offloader inside megatron-core's
#               modules (through the bridge)
#   repro       `offload-harness repro` of the seed under delays: the one-command reproduction
#   golden-new  records golden traces for the rows that have none yet (tarred to $OUT)
#   bench       scripts/bench on hybrid-small, moe-small, moe-bench and hybrid-bench, 3 rounds,
#               with the breakdown and the host time in each offloader's calls (megatron-core's
#               offloader as the mcore variant), bench.json to $OUT
# SECTIONS="seed cases ..." runs a subset (default: all, in the order above). Logs and reports
# go to $OUT (default reports/gpu-mcore); limits: T_<SECTION> seconds.
set -uo pipefail
OUT=${OUT:-reports/gpu-mcore}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SEED='mcore-hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16'
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformer_engine as te, megatron.core as mc
print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformer_engine', \
te.__version__, '| megatron-core', mc.__version__)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

SECTIONS=${SECTIONS:-seed seed-delays cases moe-delays bridge repro golden-new bench}
section() {  # section NAME LIMIT COMMAND...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  [[ " $SECTIONS " == *" $name "* ]] || return 0
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? in $((SECONDS - start))s"
  tail -n "${TAIL:-12}" "$OUT/$name.log"
}
RUN=(python3 -m harness run --family mcore --device cuda --report-dir "$OUT/reports")
CASES=(python3 -m pytest -q -p no:cacheprovider --family mcore --device cuda --tb=short -rfEs
  --report-dir "$OUT/reports")

section seed "${T_SEED:-150}" "${RUN[@]}" --case "$SEED"
section seed-delays "${T_SEED_DELAYS:-90}" "${RUN[@]}" --case "$SEED" --backend 'mcore+delays'
# UPDATE_GOLDEN=1 records the mcore rows' golden traces (cases/golden/<kind>/, tarred to $OUT).
section cases "${T_CASES:-240}" "${CASES[@]}" cases/ ${UPDATE_GOLDEN:+--update-golden}
section moe-delays "${T_MOE_DELAYS:-90}" "${CASES[@]}" cases/test_equivalence.py \
  cases/test_transfers.py -k moe --backend 'mcore+delays'
section bridge "${T_BRIDGE:-90}" "${CASES[@]}" cases/test_equivalence.py cases/test_transfers.py \
  --backend reference
section repro "${T_REPRO:-120}" python3 -m harness repro --case "$SEED" --backend 'mcore+delays' \
  --device cuda --report-dir "$OUT/reports"
# Rows without a golden file for this machine's fingerprint: record theirs (the others are left
# as committed).
if [[ " $SECTIONS " == *" golden-new "* ]]; then
  mapfile -t NEW < <(python3 - <<'PY'
import torch
from harness.measure import fingerprint
from harness.verify import golden
from harness.cases import MCORE_ROWS
here = fingerprint.of(torch.device("cuda"))
root = golden.golden_root()
for row in MCORE_ROWS:
    path = None if root is None else golden.golden_path(here.id, "small", row.name, root)
    if path is None or not path.exists():
        print(f"cases/test_golden.py::test_golden_baseline[{row.name}]")
PY
  )
  if ((${#NEW[@]})); then
    section golden-new "${T_GOLDEN_NEW:-150}" "${CASES[@]}" --update-golden "${NEW[@]}"
  fi
fi
section bench "${T_BENCH:-400}" python3 scripts/bench --models hybrid-small,moe-small,moe-bench,hybrid-bench \
  --rounds 3 --breakdown --host-time 5 --out "$OUT/bench"
tar -czf "$OUT/reports.tgz" -C "$OUT" reports 2>/dev/null && rm -rf "$OUT/reports"
if [ -n "${UPDATE_GOLDEN:-}" ] || [[ " $SECTIONS " == *" golden-new "* ]]; then
  tar -czf "$OUT/golden.tgz" cases/golden/*/mcore-*
fi
