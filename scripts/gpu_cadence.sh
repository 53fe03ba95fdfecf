#!/usr/bin/env bash
# GPU runs of the cadence work (issue 50), for the lead on a lent device: the default matrix on
# CUDA with the reference (every check: the cadence check, and the memory check's backward
# reading at the group boundaries, which must be predicted to the byte), the two cadence-broken
# offloaders (each must fail cadence, and memory where its reloads raise the backward peak), and
# megatron-core's fraction row (the #7575 class shows in its cadence line). Logs and reports go
# to $OUT (default reports/gpu-cadence). Each section has its own time limit; SECTIONS picks
# some (default "reference broken mcore"), e.g. SECTIONS=reference to stay under one call's 600 s.
set -uo pipefail
SECTIONS=" ${SECTIONS:-reference broken mcore} "
OUT=${OUT:-reports/gpu-cadence}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  # the commit a report records: git's, else OFFLOAD_HARNESS_COMMIT's (a tree copied without .git)
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo "${OFFLOAD_HARNESS_COMMIT:-unknown}")"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

summary() {  # the cadence and backward-memory lines of a report folder's summary.json
  python3 - "$1" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*/summary.json")):
    for case in json.loads(path.read_text())["cases"]:
        checks = case.get("checks", {})
        back = (case.get("memory") or {}).get("backward")
        print(case["name"], case["verdict"],
              "cadence", checks.get("cadence", {}).get("status"),
              "memory", checks.get("memory", {}).get("status"), "backward", back)
        print("   ", (case.get("cadence") or {}).get("summary"))
        for problem in case.get("problems", [])[:2]:
            print("    !", problem[:400])
PY
}

if [[ $SECTIONS == *" reference "* ]]; then
start=$SECONDS
timeout "${T_REF:-420}" python3 -m harness run --device cuda --backend reference \
  --report-dir "$OUT/reference" > "$OUT/reference.log" 2>&1
echo "reference, default matrix rc=$? in $((SECONDS - start))s"; tail -n 3 "$OUT/reference.log"
summary "$OUT/reference" > "$OUT/reference-cadence.txt"; cat "$OUT/reference-cadence.txt"
fi

if [[ $SECTIONS == *" broken "* ]]; then
for broken in broken.eager_reload broken.two_ahead; do
  start=$SECONDS
  timeout "${T_BROKEN:-300}" python3 -m harness mutation-score --device cuda --only "$broken" \
    > "$OUT/$broken.log" 2>&1
  echo "$broken rc=$? in $((SECONDS - start))s"; tail -n 6 "$OUT/$broken.log"
done
fi

# megatron-core 0.19.2's fraction row (activation_offload_fraction 0.5): its cadence line says
# how many groups were reloaded ahead at once (more than the rule allows: a failure naming them).
if [[ $SECTIONS == *" mcore "* ]]; then
start=$SECONDS
timeout "${T_MCORE:-300}" python3 -m harness run --device cuda --family mcore \
  --case "mcore-hybrid-+-+-+-_core_attn+attn_proj_sequential_bf16_fraction-0.5" \
  --report-dir "$OUT/mcore-fraction" > "$OUT/mcore-fraction.log" 2>&1
echo "mcore fraction row rc=$? in $((SECONDS - start))s"; tail -n 3 "$OUT/mcore-fraction.log"
summary "$OUT/mcore-fraction" | tee "$OUT/mcore-fraction-cadence.txt"
fi
