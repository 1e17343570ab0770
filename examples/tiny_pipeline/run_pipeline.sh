#!/usr/bin/env bash
# The pipeline demo (make demo-pipeline): from preference pairs to a policy on the CPU, every stage
# a launch of its own, each taking the previous stage's checkpoint as it wrote it:
#   1. SFT of a tiny random policy on demonstrations          (sft.yaml)
#   2. a reward model from pairs labelled by a hidden rule, starting from the SFT policy's body with
#      a new score head (rm.yaml; its accuracy on held-out pairs)
#   3. PPO from the SFT policy against the learned reward     (ppo.yaml)
#   4. DPO from the SFT policy on the same pairs              (dpo.yaml)
# then the hidden rule's score (hidden_rule.py) of the SFT, PPO and DPO policies' answers.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
OUT=$(realpath -m "${OUT:-outputs/pipeline}")  # absolute: a load path is read against its config file
NPROC=${NPROC:-2}

launch() {
    OMP_NUM_THREADS=1 "$BIN/torchrun" --nproc_per_node="$NPROC" -m megatron_rlhf.train --overwrite "$@"
}
# The trained role's directory in a run's latest checkpoint.
latest() {
    echo "$1/checkpoints/$(cat "$1/checkpoints/latest")/$2"
}

launch --config examples/tiny_pipeline/sft.yaml --output-dir "$OUT/sft"
SFT=$(latest "$OUT/sft" policy)
REWARD_LOAD=$SFT launch --config examples/tiny_pipeline/rm.yaml --output-dir "$OUT/rm"  # the SFT body, a new score head
RM=$(latest "$OUT/rm" reward)
POLICY_LOAD=$SFT REWARD_LOAD=$RM launch --config examples/tiny_pipeline/ppo.yaml --output-dir "$OUT/ppo"
POLICY_LOAD=$SFT launch --config examples/tiny_pipeline/dpo.yaml --output-dir "$OUT/dpo"
OMP_NUM_THREADS=1 "$BIN/torchrun" --nproc_per_node=1 examples/tiny_pipeline/hidden_rule.py \
    "$SFT" "$(latest "$OUT/ppo" ppo_policy)" "$(latest "$OUT/dpo" policy)"
