#!/usr/bin/env bash
# One GPU run that answers two questions, in about 10 minutes. Installs nothing: it uses the first
# Python whose jax sees a GPU among $PYTHON, the repo's .venv and python3, with PYTHONPATH=. (no
# network needed; grain is not needed).
#
#     benchmarks/gpu_check.sh
#
# 1. which machine: jax.devices(), nvidia-smi (exits 1 when jax sees no GPU);
# 2. target-only vs EAGLE-3 tok/s on the demo pair at batch 1, 8 and 32, greedy, fixed K = 2 and 4
#    and auto, identical tokens checked (benchmarks/speedup.py);
# 3. the expert-kernel choice: blocked loop vs ragged_dot (grouped matmul) vs a dense reference at
#    8 to 384 experts, decode and prefill row counts (benchmarks/moe_dispatch.py).
# Both run through benchmarks/run_all.py, so the answer is JSON plus a RESULTS.md, written under $OUT
# (else /tmp/gpu_check): results/*.json, RESULTS.md, gpu_check.log. Each step runs under `timeout`;
# a failed step does not stop the next, but the exit status is non-zero.
#
# Knobs: GPU_CHECK_ALLOW_CPU=1 runs without a GPU (a plumbing check); GPU_CHECK_QUICK=1 passes
# --quick (tiny sizes, seconds of work after compiles).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
SPEEDUP_TIMEOUT_S=420
MOE_TIMEOUT_S=150

has_gpu() {   # exit status 0 when this interpreter's jax lists a GPU device
    "$1" -c "import jax, sys; sys.exit(0 if any(d.platform == 'gpu' for d in jax.devices()) else 1)" 2>/dev/null
}

pick_python() {
    local candidates=()
    [ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
    [ -x .venv/bin/python ] && candidates+=(.venv/bin/python)
    candidates+=(python3)
    for py in "${candidates[@]}"; do
        if has_gpu "$py"; then echo "$py"; return 0; fi
    done
    echo "${candidates[0]}"   # none sees a GPU: report with the first one
    return 1
}

run_step() {   # run_step TIMEOUT_S NAME ARGS...: one benchmark through run_all.py under a timeout
    local limit=$1 name=$2; shift 2
    echo
    echo "== $name (timeout ${limit}s)"
    # shellcheck disable=SC2086  # QUICK is an optional flag
    timeout "$limit" "$py" benchmarks/run_all.py --only "$name" --out "$OUT_DIR/results" \
        --results-md "$OUT_DIR/RESULTS.md" ${QUICK:-} "$@" \
        || { echo "error: $name failed or timed out (status $?)" >&2; return 1; }
}

main() {
    local status=0
    echo "== gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    py=$(pick_python)
    local found=$?
    echo "== python: $py"
    "$py" -c "import jax; print('jax', jax.__version__, jax.default_backend()); print('jax.devices():', jax.devices())" || return 1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    if [ "$found" -ne 0 ] && [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
        echo "error: no GPU visible to jax (tried \$PYTHON, .venv/bin/python, python3); install jax[cuda] there" >&2
        return 1
    fi
    if [ ! -f demo/draft/config.json ]; then
        echo "error: demo/draft is missing; the speedup step needs the shipped demo pair" >&2
        return 1
    fi
    [ "${GPU_CHECK_QUICK:-0}" = 1 ] && QUICK=--quick

    # greedy only, two fixed K beside auto and 2 timed passes: the matrix's GPU answer in minutes
    run_step "$SPEEDUP_TIMEOUT_S" speedup --script-args "--batch 1,8,32 --temperature 0 --k 2,4 --repeats 2" \
        || status=1
    run_step "$MOE_TIMEOUT_S" moe_dispatch || status=1

    echo
    echo "== gpu_check done, status $status; results: $OUT_DIR/RESULTS.md, $OUT_DIR/results/*.json; log: $LOG"
    return "$status"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
