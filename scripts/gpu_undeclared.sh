#!/usr/bin/env bash
# Offloaders that declare nothing, on a GPU: the corpus of correct undeclared offloaders
# (tests/helpers/undeclared_offloaders.py, each over the default matrix), their broken variants, the
# declared backends that must pass as before (the reference, save-on-cpu), and TransformerEngine's
# context (`te`, both implementations) where it imports. Each `run` prints the rule it learned per
# case. Logs and reports go to $OUT (default reports/gpu-undeclared); each section has its own
# time limit (T_<SECTION>, seconds) so one slow part cannot eat the others' output.
# SECTIONS="corpus te ..." runs a subset (default: corpus broken declared te mcore).
set -uo pipefail
OUT=${OUT:-reports/gpu-undeclared}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/tests/helpers${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
SECTIONS=${SECTIONS:-corpus broken declared te mcore}
RUN=(python3 -m harness run --device cuda --report-dir "$OUT/reports")
summary() {  # the run's last line and every distinct learned rule, counted
  grep -E "cases? (passed|failed)|error:|^offload-harness:" "$1" | tail -n 3
  grep -E "^  (observed rule|no single rule)" "$1" | sort | uniq -c | sort -rn | head -n 6
}
section() {  # section NAME LIMIT LABEL COMMAND...
  local name=$1 limit=$2 label=$3 start=$SECONDS
  shift 3
  [[ " $SECTIONS " == *" $name "* ]] || return 0
  timeout "$limit" "$@" > "$OUT/$label.log" 2>&1
  echo "== $label rc=$? in $((SECONDS - start))s"
  summary "$OUT/$label.log"
}
for style in PinnedStreams StorageSkip ObjectSkip SizeThreshold WholeStorage HandBack; do
  section corpus "${T_CORPUS:-90}" "$style" "${RUN[@]}" --backend "undeclared_offloaders:$style"
done
for variant in DropsOneReload EvenStepsOnly MovesMarked ThresholdDrifts; do
  section broken "${T_BROKEN:-90}" "$variant" "${RUN[@]}" --backend "undeclared_offloaders:$variant"
done
for backend in reference save-on-cpu; do
  section declared "${T_DECLARED:-90}" "$backend" "${RUN[@]}" --backend "$backend"
done
for v1 in 0 1; do
  section te "${T_TE:-120}" "te-v1-$v1" "${RUN[@]}" --backend te --nvte-cpu-offload-v1 "$v1"
done
section mcore "${T_MCORE:-200}" mcore "${RUN[@]}" --family mcore
