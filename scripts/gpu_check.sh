#!/usr/bin/env bash
# GPU validation in one go: the unit tests (CUDA ones included), the case matrix on CUDA with
# its report (the host-sync case cases/test_sync.py included), the host-sync case against the
# deliberately syncing backend (it must fail), and the step-time/copy-rate benchmark. Logs and
# reports go to $OUT (default reports/gpu). Each section has its own time limit so one slow part
# cannot eat the others' output.
set -uo pipefail
OUT=${OUT:-reports/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
start=$SECONDS
timeout "${T_TESTS:-200}" python3 -m pytest -q -p no:cacheprovider tests/ --device cuda \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? in $((SECONDS - start))s"; tail -n 4 "$OUT/tests.log"
start=$SECONDS
timeout "${T_CASES:-280}" python3 -m pytest -q -p no:cacheprovider cases/ --device cuda \
  --matrix "${MATRIX:-default}" --report-dir "$OUT" --junitxml "$OUT/junit-cases.xml" \
  > "$OUT/cases.log" 2>&1
echo "cases rc=$? in $((SECONDS - start))s"; tail -n 4 "$OUT/cases.log"
start=$SECONDS
# Mutation check of the sync case: the first case must fail, naming step, microbatch and group.
timeout "${T_SYNC:-90}" python3 -m pytest -q -p no:cacheprovider -x cases/test_sync.py \
  --device cuda --backend "${SYNC_BROKEN:-broken.host_sync}" > "$OUT/sync-broken.log" 2>&1
echo "sync case vs ${SYNC_BROKEN:-broken.host_sync} rc=$? (1 expected) in $((SECONDS - start))s"
grep -m 3 "synchronised the host" "$OUT/sync-broken.log"
start=$SECONDS
timeout "${T_BENCH:-420}" python3 scripts/bench --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $((SECONDS - start))s"; cat "$OUT/bench.log"
