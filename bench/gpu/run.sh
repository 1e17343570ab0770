#!/usr/bin/env bash
# The GPU kit: runs on the GPU machine in one call (or a few, by step) and writes every figure to
# $OUT. On a machine without CUDA, MEGATRON_RLHF_DEVICE=cpu runs every step but the CUDA work
# (small sizes; the wheels are checked against Python 3.12 instead of installed).
#
#   bash bench/gpu/run.sh                       # every default step, on the GPU
#   bash bench/gpu/run.sh tests ems             # some steps
#   MEGATRON_RLHF_DEVICE=cpu bash bench/gpu/run.sh
#
# Steps (default: setup env tests ems generation grpo planner attention demo): setup installs the
# wheels of bench/gpu/prepare.sh; env records the machine; tests runs the gpu-marked tests; ems,
# generation and planner run bench/ems.py, bench/generation.py (against transformers) and
# bench/planner_accuracy.py; grpo GRPO iterations side by side with TRL's GRPOTrainer (bench/peer_trl.py:
# one process on the card each, bf16, the math task on a model of the GPU's size); attention a 4096-token training step, fused against local; demo runs the tiny PPO demo with EMS on, off, and on with overlapped
# onloads, and compares their metrics. `suite` (not a default) runs the whole test suite.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
REPO=$PWD
export MEGATRON_RLHF_DEVICE=${MEGATRON_RLHF_DEVICE:-cuda}
OUT=${OUT:-$REPO/outputs/gpu_kit}
WHEELS=$REPO/bench/gpu/wheels
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(setup env tests ems generation grpo planner attention demo)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONWARNINGS=ignore TENSORBOARD=False

if [ "$MEGATRON_RLHF_DEVICE" = cuda ]; then
    # The machine's Python with its CUDA torch; our packages go to a folder of their own.
    PY=${PYTHON:-python3}
    SITE=${KIT_SITE:-/tmp/megatron-rlhf-kit-site}
    export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
    ems_model=(--hidden 2048 --layers 16 --heads 16 --groups 4 --ffn 5632 --vocab 32000 --seq-length 1024 --micro-batch-size 2)
    generation_model=(--hidden 1024 --layers 8 --heads 16 --kv-heads 4 --ffn 2816 --vocab 32000 --precision bf16
                      --prompts 256 --slots 256 --max-prompt 1024 --new-tokens 256)  # every row at once: a KV cache of 2.5 GiB
    demo_iterations=40
    grpo_run=(--iterations 10 --skip 3 --hidden 1024 --layers 8 --new-tokens 128 --lr 1e-5)
    attention_model=(--models kit --batch 1 --seq 4096 --precision bf16)
else
    PY=${PYTHON:-$REPO/.venv/bin/python}
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    ems_model=(--preset tiny --steps 2 --repeats 2)
    generation_model=(--prompts 8 --min-prompt 8 --max-prompt 64 --new-tokens 16 --slots 4)
    demo_iterations=3
    grpo_run=(--iterations 3 --skip 1)
    attention_model=(--models tiny --batch 2 --seq 256)
fi

step_setup() {
    [ -f "$WHEELS/requirements.txt" ] || { echo "no $WHEELS/requirements.txt: run bench/gpu/prepare.sh first (where there is a network)"; return 1; }
    find "$WHEELS" -name "*.whl" | wc -l
    if [ "$MEGATRON_RLHF_DEVICE" = cuda ]; then
        "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl || return 1
        "$PY" -c "import megatron.core, transformers, torch; print('megatron-core', megatron.core.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__, 'CUDA', torch.version.cuda)"
    else
        # What the GPU machine's install will do, resolved for Python 3.12 without installing.
        "$PY" -m pip install --dry-run --quiet --no-index --no-deps --find-links "$WHEELS" --only-binary=:all: \
            --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
            --target "$(mktemp -d)" -r "$WHEELS/requirements.txt" && echo "every requirement resolves to a Python 3.12 wheel in $WHEELS"
    fi
}

step_env() {
    date -u +%Y-%m-%dT%H:%M:%SZ
    "$PY" - <<'PY'
import platform, torch
from megatron_rlhf.runtime import get_platform
p = get_platform()
print(f"python {platform.python_version()} | torch {torch.__version__} | platform {p.name} | transformer-engine {p.has_transformer_engine}")
if p.name == "cuda":
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible, CUDA {torch.version.cuda}")
print("fusions:", {k: v for k, v in p.kernel_fusions().items() if v} or "none")
PY
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    return 0
}

# KIT_TESTS: what pytest collects, space-separated (default: every gpu-marked test under tests/).
step_tests() {
    local collect
    read -r -a collect <<< "${KIT_TESTS:-tests}"
    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs "${collect[@]}" --junitxml="$OUT/gpu_tests.xml"
}
step_suite() { "$PY" -m pytest -q -p no:cacheprovider -rs tests --junitxml="$OUT/suite.xml"; }
step_ems() { "$PY" bench/ems.py "${ems_model[@]}" --json "$OUT/ems.json"; }
step_generation() { "$PY" bench/generation.py "${generation_model[@]}" --json "$OUT/generation.json"; }
step_grpo() { "$PY" bench/peer_trl.py --device "$MEGATRON_RLHF_DEVICE" "${grpo_run[@]}" --json "$OUT/grpo.json"; }
step_planner() { "$PY" bench/planner_accuracy.py --json "$OUT/planner_accuracy.json"; }
# A training step at 4096 tokens with torch's fused attention and with megatron's local one: the
# activations kept, the allocator's peak and the seconds, the planner's prediction beside them.
step_attention() { "$PY" bench/planner_accuracy.py "${attention_model[@]}" --attention fused local --json "$OUT/attention.json"; }

step_demo() {
    # EMS on, off, and on with overlapped onloads (the side stream): the same metrics all three.
    local run mode free overlap
    for mode in on off overlap; do
        run=$OUT/demo_ems_$mode
        free=$([ $mode = off ] && echo False || echo True)
        overlap=$([ $mode = overlap ] && echo True || echo False)
        env TP=1 ITERATIONS="$demo_iterations" OVERLAP_ONLOAD="$overlap" free_memory_policy="$free" \
            free_memory_reference="$free" free_memory_value="$free" free_memory_ppo_policy="$free" free_memory_ppo_value="$free" \
            "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m megatron_rlhf.train \
            --config examples/tiny/rlhf.yaml --output-dir "$run" --overwrite || return 1
        tail -n 1 "$run/metrics.jsonl" | cut -c1-300
    done
    "$PY" bench/gpu/compare_runs.py "$OUT/demo_ems_on" "$OUT/demo_ems_off" &&
        "$PY" bench/gpu/compare_runs.py "$OUT/demo_ems_on" "$OUT/demo_ems_overlap"
}

failed=()
for step in "${steps[@]}"; do
    declare -F "step_$step" >/dev/null || { echo "unknown step $step (steps: setup env tests suite ems generation grpo planner attention demo)"; exit 2; }
    echo "=== $step ($MEGATRON_RLHF_DEVICE) ==="
    started=$SECONDS
    "step_$step" > >(tee "$OUT/$step.log") 2>&1
    status=$?
    echo "$step: exit $status in $((SECONDS - started)) s" | tee -a "$OUT/steps.txt"
    [ $status -eq 0 ] || failed+=("$step")
done
[ ${#failed[@]} -eq 0 ] || { echo "failed steps: ${failed[*]} (logs in $OUT)"; exit 1; }
echo "all steps passed; figures and logs in $OUT"
