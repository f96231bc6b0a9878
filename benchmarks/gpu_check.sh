#!/usr/bin/env bash
# The demo and the speedup benchmark on a GPU machine, in about 8 minutes. Installs nothing: it
# uses the first Python whose jax sees a GPU among $PYTHON, the repo's .venv and python3.
#
#     benchmarks/gpu_check.sh
#
# 1. prints jax.devices() (exits 1 when no GPU is visible);
# 2. `python serve.py`: the embedded demo (demo/target + demo/draft), its completions and table;
# 3. benchmarks/demo_speedup.py --batch 1,8,32 --repeats 2: measured speedup of the demo pair and the
#    projection on a big random target (bfloat16, as a GPU serves it).
# Each step runs under `timeout`; a failed step does not stop the next, but the exit status is
# non-zero. Output is also written to $OUT (else /tmp): gpu_check.log, demo_speedup_gpu.json.
#
# Knobs for a plumbing check elsewhere: GPU_CHECK_ALLOW_CPU=1 skips the GPU requirement;
# SPEEDUP_ARGS="..." appends flags to demo_speedup.py (later flags win).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${OUT:-/tmp}
LOG="$OUT_DIR/gpu_check.log"
DEMO_TIMEOUT_S=150
SPEEDUP_TIMEOUT_S=330

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

main() {
    local py status=0
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

    echo
    echo "== demo: python serve.py (timeout ${DEMO_TIMEOUT_S}s)"
    if [ ! -f demo/draft/config.json ]; then
        echo "error: demo/draft is missing; build the demo first (python tools/make_demo.py)" >&2
        status=1
    else
        timeout "$DEMO_TIMEOUT_S" "$py" serve.py || { echo "error: the demo failed or timed out (status $?)" >&2; status=1; }
    fi

    echo
    echo "== speedup: benchmarks/demo_speedup.py --batch 1,8,32 (timeout ${SPEEDUP_TIMEOUT_S}s)"
    # shellcheck disable=SC2086  # SPEEDUP_ARGS is a list of flags
    timeout "$SPEEDUP_TIMEOUT_S" "$py" benchmarks/demo_speedup.py --batch 1,8,32 --repeats 2 --proj-dtype bfloat16 \
        --json "$OUT_DIR/demo_speedup_gpu.json" ${SPEEDUP_ARGS:-} \
        || { echo "error: demo_speedup.py failed or timed out (status $?)" >&2; status=1; }

    echo
    echo "== gpu_check done, status $status; log: $LOG"
    return "$status"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
