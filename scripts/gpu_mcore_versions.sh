#!/usr/bin/env bash
# The mcore family under megatron-core 0.19.2 and under upstream main, side by side, on a GPU box
# where TransformerEngine is staged (PYTHONPATH holds TransformerEngine and megatron-core 0.19.2,
# e.g. /root/te-site) and this checkout carries the main wheel built by scripts/mcore_main
# (.mcore-main/, git-ignored: name it in the device call's carry).
#
#   scripts/gpu_mcore_versions.sh [STEP...]      steps: install features 0192 main table
#
#   install   pip-installs .mcore-main/*.whl (no index, no deps) into $MAIN_SITE
#   features  python -m harness.models.mcore.features under each install
#   0192      offload-harness run --models mcore $RUN_ARGS with the staged 0.19.2
#   main      the same with $MAIN_SITE first on PYTHONPATH (megatron-core from main; the
#             staged TransformerEngine and other wheels still come from PYTHONPATH)
#   table     scripts/mcore_versions table of the two newest summary.json files
#
# Default: all steps in order. The family takes longer than one 10-minute device call: run
# `install features 0192` in one call and `install main table` in the next (reports stay under
# reports/mcore-versions/, git-ignored, kept between calls on a warm box), or narrow RUN_ARGS
# (e.g. RUN_ARGS="--device cuda --case ID --case ID"). Logs, summaries and table.txt go to $OUT.
set -uo pipefail
OUT=${OUT:-reports/gpu-mcore-versions}
MAIN_SITE=${MAIN_SITE:-/tmp/mcore-main-site}
REPORTS=${REPORTS:-reports/mcore-versions}
RUN_ARGS=${RUN_ARGS:---device cuda}
BASE_PATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$REPORTS"
STEPS=${*:-install features 0192 main table}

under() {  # under 0192|main COMMAND...: run with that install's PYTHONPATH
    local which=$1
    shift
    if [ "$which" = main ]; then
        PYTHONPATH="$MAIN_SITE:$BASE_PATH" "$@"
    else
        PYTHONPATH="$BASE_PATH" "$@"
    fi
}

newest_summary() {  # newest_summary 0192|main
    ls -t "$REPORTS/$1"/*/summary.json 2>/dev/null | head -n 1
}

for step in $STEPS; do
    start=$SECONDS
    case "$step" in
        install)
            wheel=$(ls .mcore-main/megatron_core-*.whl 2>/dev/null | head -n 1)
            if [ -z "$wheel" ]; then
                echo "no .mcore-main/*.whl: build it with scripts/mcore_main and carry .mcore-main" >&2
                exit 2
            fi
            python3 -m pip install --quiet --no-index --no-deps --ignore-requires-python \
                --upgrade --target "$MAIN_SITE" "$wheel" > "$OUT/install.log" 2>&1
            echo "== install rc=$? $wheel (commit $(cat .mcore-main/COMMIT 2>/dev/null))"
            ;;
        features)
            for which in 0192 main; do
                under "$which" python3 -m harness.models.mcore.features > "$OUT/features-$which.txt" 2>&1
                echo "== features $which rc=$?"
                cat "$OUT/features-$which.txt"
            done
            ;;
        0192|main)
            # shellcheck disable=SC2086  # RUN_ARGS is a list of flags
            under "$step" python3 -m harness run --models mcore $RUN_ARGS \
                --report-dir "$REPORTS/$step" > "$OUT/run-$step.log" 2>&1
            echo "== run $step rc=$? in $((SECONDS - start))s"
            tail -n "${TAIL:-40}" "$OUT/run-$step.log"
            summary=$(newest_summary "$step")
            [ -n "$summary" ] && cp "$summary" "$OUT/summary-$step.json"
            ;;
        table)
            old=$(newest_summary 0192)
            new=$(newest_summary main)
            if [ -z "$old" ] || [ -z "$new" ]; then
                echo "table: need a summary.json under $REPORTS/0192 and $REPORTS/main" >&2
                exit 2
            fi
            PYTHONPATH="$BASE_PATH" python3 scripts/mcore_versions table "$old" "$new" \
                | tee "$OUT/table.txt"
            ;;
        *)
            echo "unknown step $step (install features 0192 main table)" >&2
            exit 2
            ;;
    esac
done
