#!/usr/bin/env bash
# GPU checks: what a CPU cannot answer. Installs nothing: it uses the first Python whose jax sees a
# GPU among $PYTHON, the repo's .venv and python3, with PYTHONPATH=. (no network, no grain needed).
#
#     benchmarks/gpu_check.sh                                   # every step, ~13 min on one H200
#     GPU_CHECK_STEPS=b8,b1 benchmarks/gpu_check.sh             # some steps: fits a 10-minute call
#
# Steps (GPU_CHECK_STEPS, comma-separated; default all, in this order). Each runs under `timeout`
# and prints its numbers as they come, so a step that runs out of time keeps what it measured:
#   quant  INT4 experts held packed through the Pallas/Triton `grouped` kernel and the `blocked`
#          loop vs the bf16 twin: tok/s and token agreement (quant_decode.py); not yet finished on
#          a GPU (three batch sizes did not finish in 80 s; now two);
#   moe    float expert kernels at serving widths in bf16: blocked loop vs ragged_dot (grouped
#          matmul) vs a dense reference, 8-256 experts, decode and prefill rows (moe_dispatch.py), ~7 s a cell;
#   b1, b8, b32
#          target-only vs EAGLE-3 tok/s on the demo pair at that batch, greedy, fixed K = 3 and auto,
#          identical tokens counted (speedup.py), ~3 min each (b8: 173 s).
# Measured on one H200 (2026-12-04): compiling is most of a step: ~30 s per decode mode (target-only,
# a fixed K) and ~95 s for auto, which compiles several Ks; 8 prompts x 32 new tokens then decode in
# seconds. Files: gpu_check.log, quant_decode.txt, moe_dispatch.txt, speedup_b<B>.json.
#
# Knobs: GPU_CHECK_ALLOW_CPU=1 runs without a GPU (a plumbing check); GPU_CHECK_QUICK=1 uses tiny
# sizes (seconds of work after compiles).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"

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

step() {   # step TIMEOUT_S NAME OUTFILE ARGS...: one script under a timeout, its stdout kept in OUTFILE
    local limit=$1 name=$2 out=$3; shift 3
    local t0=$SECONDS
    echo
    echo "== $name (timeout ${limit}s): $*"
    timeout "$limit" "$py" "$@" > >(tee "$out") 2>&1
    local rc=$?
    echo "== $name: status $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || { echo "error: $name failed or timed out (status $rc)" >&2; return 1; }
}

main() {
    local status=0
    echo "== gpu_check $(date -u '+%Y-%m-%d %H:%M UTC') on $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    py=$(pick_python)
    local found=$?
    echo "== python: $py"
    "$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.default_backend()); print('jax.devices():', jax.devices())" || return 1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    if [ "$found" -ne 0 ] && [ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]; then
        echo "error: no GPU visible to jax (tried \$PYTHON, .venv/bin/python, python3); install jax[cuda] there" >&2
        return 1
    fi
    if [ ! -f demo/draft/config.json ]; then
        echo "error: demo/draft is missing; the speedup step needs the shipped demo pair" >&2
        return 1
    fi
    local quick=${GPU_CHECK_QUICK:-0}
    local steps=",${GPU_CHECK_STEPS:-quant,moe,b1,b8,b32},"
    local qd=(--batches 1,8 --new-tokens 16 --repeats 3)
    local md=(--experts 8,64,256 --rows 8,2048 --topk 8 --hidden 2048 --ffn 1024 --dtype bfloat16 --repeats 10)
    local sp=(--prompts demo --temperature 0 --k 3 --max-new-tokens 32 --repeats 3 --parallel-draft none)
    local n1=8 n8=8 n32=32
    if [ "$quick" = 1 ]; then
        qd=(--batches 1 --new-tokens 4 --prompt-len 8 --repeats 1)
        md=(--experts 8 --rows 8 --topk 2 --hidden 64 --ffn 32 --dtype bfloat16 --repeats 1)
        sp=(--prompts demo --temperature 0 --k 2 --max-new-tokens 8 --repeats 1 --parallel-draft none)
        n1=1 n8=2 n32=2
    fi

    [[ $steps == *,quant,* ]] && { step 150 quant_decode "$OUT_DIR/quant_decode.txt" benchmarks/quant_decode.py \
        "${qd[@]}" --int4-kernels grouped,blocked || status=1; }
    [[ $steps == *,moe,* ]] && { step 100 moe_dispatch "$OUT_DIR/moe_dispatch.txt" benchmarks/moe_dispatch.py \
        "${md[@]}" || status=1; }
    for b in 1 8 32; do
        [[ $steps == *,b$b,* ]] || continue
        local n_var="n$b"
        step 240 "speedup B=$b" "$OUT_DIR/speedup_b$b.txt" benchmarks/speedup.py "${sp[@]}" --batch "$b" \
            --num-prompts "${!n_var}" --json "$OUT_DIR/speedup_b$b.json" || status=1
        rm -f "$OUT_DIR/speedup_b$b.txt"   # its table is in the log and the JSON; keeps the file count low
    done

    echo
    echo "== gpu_check done, status $status; files in $OUT_DIR; log: $LOG"
    return "$status"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
