#!/usr/bin/env bash
# The judge demo (make demo-judge): rewards from a model that reads, on the CPU.
#   1. a tiny judge learns by SFT to rate answers 0-9 by the pipeline demo's hidden rule (the
#      share of vowels), from ratings it is shown (judge_sft.yaml; make_data.py writes them)
#   2. GRPO of a tiny random policy scored by the judge alone: every response is read by the judge
#      in a phase of its own, its rating / 9 the reward (grpo.yaml)
# then the hidden rule's score, measured without the judge (examples/tiny_pipeline/hidden_rule.py),
# of the policy GRPO starts from and of the policy it ends with.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
OUT=$(realpath -m "${OUT:-outputs/judge}")  # absolute: a load path is read against its config file
NPROC=${NPROC:-2}
ALPHABET="abcdefghijklmnopqrstuvwxyz 0123456789|"

launch() {
    OMP_NUM_THREADS=1 "$BIN/torchrun" --nproc_per_node="$NPROC" -m megatron_rlhf.train --overwrite "$@"
}
# The trained role's directory in a run's latest checkpoint.
latest() {
    echo "$1/checkpoints/$(cat "$1/checkpoints/latest")/$2"
}

launch --config examples/tiny_judge/judge_sft.yaml --output-dir "$OUT/judge_sft"
export JUDGE_LOAD
JUDGE_LOAD=$(latest "$OUT/judge_sft" policy)
launch --config examples/tiny_judge/grpo.yaml --output-dir "$OUT/grpo"
OMP_NUM_THREADS=1 "$BIN/torchrun" --nproc_per_node=1 examples/tiny_pipeline/hidden_rule.py --alphabet "$ALPHABET" \
    initial:examples/tiny_judge/grpo.yaml "$(latest "$OUT/grpo" ppo_policy)"
