#!/usr/bin/env bash
# GPU checks: what a CPU cannot answer, in one command that answers within 10 minutes on one H100
# or H200, compiles included. Installs nothing: it uses the first Python whose jax sees a GPU among
# $PYTHON, the repo's .venv and python3, with PYTHONPATH=. (no network, no grain needed).
#
#     benchmarks/gpu_check.sh                           # the default steps, within GPU_CHECK_BUDGET_S (570 s)
#     GPU_CHECK_STEPS=rounds,b8 benchmarks/gpu_check.sh # some steps
#
# Steps (GPU_CHECK_STEPS, comma-separated, run in this order). Each prints its rows as they come
# and writes JSON; each is given what is left of the budget (a step that would start with less
# than it needs is skipped and says so), so the command ends in time with what it measured:
#   rounds  (a) round costs measured beside their roofline (benchmarks/round_costs.py): a
#           DeepSeek-V3-architecture target at full width cut to 5 layers (3 dense, 2 MoE: ~35 GB),
#           FP8 experts and linears, random weights, batch 1/8/32, K = 0..6, context 512; the
#           roofline with the datasheet figures of the GPU found (tools/plan/roofline.CHIPS);
#   b8, b1, b32
#           (b) the demo pair, target-only vs EAGLE-3 fixed K = 3 and auto, greedy, tok/s and
#           identical tokens (speedup.py), ~3 min each on an H200 (compiles ~30 s a mode, ~95 s auto);
#   moe     (c) float expert kernels at serving widths in bf16: blocked loop vs ragged_dot vs a
#           dense reference, 8-256 experts, decode and prefill rows (moe_dispatch.py), ~7 s a cell;
#   cmdbuf  XLA's GPU command buffers (graph capture) off vs on: the demo pair's rounds at batch 8,
#           K = 0 and 3, measured with --xla_gpu_enable_command_buffer= (off) and the default (on);
#   quant   (not in the default list) INT4 experts held packed through the grouped kernel vs the
#           blocked loop vs the bf16 twin (quant_decode.py), ~150 s.
# Files in $OUT (default /tmp/gpu_check): gpu_check.log, gpu_check.json (steps, status, seconds,
# files), round_costs.json, speedup_b<B>.json, moe_dispatch.txt, cmdbuf_off.json, cmdbuf_on.json.
#
# Knobs: GPU_CHECK_ALLOW_CPU=1 runs without a GPU (a plumbing check); GPU_CHECK_QUICK=1 uses tiny
# sizes (seconds of work after compiles; the suite's smoke test runs it this way on CPU).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
BUDGET=${GPU_CHECK_BUDGET_S:-570}
STEPS_JSON=""

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

record() {   # record NAME STATUS SECONDS FILES: one entry of gpu_check.json
    STEPS_JSON+="${STEPS_JSON:+,}{\"name\": \"$1\", \"status\": \"$2\", \"seconds\": $3, \"files\": \"$4\"}"
}

step() {   # step NEED_S LIMIT_S NAME FILES ARGS...: one script under what is left of the budget
    local need=$1 limit=$2 name=$3 files=$4; shift 4
    local left=$((BUDGET - SECONDS))
    echo
    if [ "$left" -lt "$need" ]; then
        echo "== $name: skipped, ${left} s of the ${BUDGET} s budget left and it needs ~${need} s"
        record "$name" skipped 0 ""
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    echo "== $name (timeout ${limit}s): $*"
    timeout "$limit" "$@" 2>&1
    local rc=$?
    echo "== $name: status $rc after $((SECONDS - t0)) s"
    record "$name" "$rc" "$((SECONDS - t0))" "$files"
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
        echo "error: demo/draft is missing; the demo pair steps need the shipped demo pair" >&2
        return 1
    fi
    local quick=${GPU_CHECK_QUICK:-0}
    local steps=",${GPU_CHECK_STEPS:-rounds,b8,moe,cmdbuf,b1,b32},"
    local rc_args=(--model configs/models/deepseek_v3.json --layers 5 --batches 1,8,32 --ks 0,1,2,3,4,5,6
                   --context 512 --rounds 10 --repeats 5)
    local cb_args=(--pair demo --batches 8 --ks 0,3 --context 256 --rounds 20 --repeats 5)
    local qd=(--batches 1,8 --new-tokens 16 --repeats 3)
    local md=(--experts 8,64,256 --rows 8,2048 --topk 8 --hidden 2048 --ffn 1024 --dtype bfloat16 --repeats 10)
    local sp=(--prompts demo --temperature 0 --k 3 --max-new-tokens 32 --repeats 3 --parallel-draft none)
    local n1=8 n8=8 n32=32 rounds_s=240 speed_s=240 need_speed=150 small_s=90
    if [ "$quick" = 1 ]; then
        rc_args=(--tiny)
        cb_args=(--tiny --ks 0)
        qd=(--batches 1 --new-tokens 4 --prompt-len 8 --repeats 1)
        md=(--experts 8 --rows 8 --topk 2 --hidden 64 --ffn 32 --dtype bfloat16 --repeats 1)
        sp=(--prompts demo --temperature 0 --k 1 --max-new-tokens 4 --repeats 1 --parallel-draft none)
        # a CPU compiles slowly (minutes on a busy 2-core host): the budget alone bounds the steps
        n1=1 n8=2 n32=2 need_speed=10 rounds_s=900 speed_s=900 small_s=600
    fi
    local cmdbuf_off="--xla_gpu_enable_command_buffer="
    "$py" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" 2>/dev/null || cmdbuf_off=""

    for name in ${steps//,/ }; do
        case $name in
            rounds)
                step 60 "$rounds_s" rounds round_costs.json "$py" benchmarks/round_costs.py "${rc_args[@]}" \
                    --budget-s $((rounds_s - 60)) --json "$OUT_DIR/round_costs.json" || status=1 ;;
            b1|b8|b32)
                local b=${name#b} n_var="n${name#b}"
                step "$need_speed" "$speed_s" "speedup B=$b" "speedup_b$b.json" "$py" benchmarks/speedup.py "${sp[@]}" \
                    --batch "$b" --num-prompts "${!n_var}" --json "$OUT_DIR/speedup_b$b.json" || status=1 ;;
            moe)
                step 30 "$small_s" moe_dispatch moe_dispatch.txt bash -c "\"$py\" benchmarks/moe_dispatch.py ${md[*]} | tee \"$OUT_DIR/moe_dispatch.txt\"" \
                    || status=1 ;;
            cmdbuf)
                [ -n "$cmdbuf_off" ] || echo "== cmdbuf: no GPU, the flag is left out (both runs alike: a plumbing check)"
                local flags="${XLA_FLAGS:-}${cmdbuf_off:+ $cmdbuf_off}" envs=()
                [ -n "$flags" ] && envs=("XLA_FLAGS=$flags")
                step 40 "$small_s" "command buffers off" cmdbuf_off.json env "${envs[@]}" "$py" \
                    benchmarks/round_costs.py "${cb_args[@]}" --label "command buffers off ($cmdbuf_off)" \
                    --json "$OUT_DIR/cmdbuf_off.json" || status=1
                step 40 "$small_s" "command buffers on" cmdbuf_on.json "$py" benchmarks/round_costs.py "${cb_args[@]}" \
                    --label "command buffers: XLA's default" --json "$OUT_DIR/cmdbuf_on.json" || status=1 ;;
            quant)
                step 60 150 quant_decode quant_decode.txt bash -c "\"$py\" benchmarks/quant_decode.py ${qd[*]} --int4-kernels grouped,blocked | tee \"$OUT_DIR/quant_decode.txt\"" \
                    || status=1 ;;
            *) echo "error: unknown step '$name' (rounds, b1, b8, b32, moe, cmdbuf, quant)" >&2; status=1 ;;
        esac
    done

    printf '{"date": "%s", "commit": "%s", "python": "%s", "budget_s": %s, "seconds": %s, "status": %s, "steps": [%s]}\n' \
        "$(date -u '+%Y-%m-%d %H:%M UTC')" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" "$py" "$BUDGET" \
        "$SECONDS" "$status" "$STEPS_JSON" > "$OUT_DIR/gpu_check.json"
    echo
    echo "== gpu_check done, status $status after $SECONDS s; files in $OUT_DIR; log: $LOG"
    return "$status"
}

main 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
