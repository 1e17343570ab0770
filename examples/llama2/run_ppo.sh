#!/usr/bin/env bash
# PPO for Llama-2 with megatron-rlhf, configured from environment variables. On one node:
#
#   export MODEL_SIZE=7b POLICY_LOAD=/ckpt/llama2-7b-sft-tp2 REWARD_LOAD=/ckpt/llama2-7b-rm-tp2 \
#          TOKENIZER=/models/Llama-2-7b-hf/tokenizer.json PROMPT_FILE=/data/prompts.jsonl
#   bash examples/llama2/run_ppo.sh [extra megatron_rlhf.train flags, e.g. --overwrite]
#
# The plan of a launch (resolved config, layout, memory per role), on any machine, GPU or not:
#
#   DRY_RUN=1 MODEL_SIZE=70b bash examples/llama2/run_ppo.sh
#
# On several nodes run it once per node with MASTER_ADDR (the first node) and NNODES set, or submit
# slurm/run_ppo.sbatch. Every input is checked before anything is launched.
#
# Variables (default in brackets; MODEL_SIZE sets the ones marked *):
#   MODEL_SIZE               policy size: 7b, 13b, 70b, or tiny (a random tiny model, to check a
#                            cluster's set-up end to end; needs no checkpoint or tokenizer) [7b]
#   REWARD_MODEL_SIZE        reward/value size [MODEL_SIZE]
#   POLICY_LOAD              converted SFT checkpoint (tools/convert_hf_to_megatron.py): reference, ppo_policy
#   REWARD_LOAD              converted reward model (score head): reward
#   VALUE_LOAD               starting point of the value model [REWARD_LOAD]
#   TOKENIZER                the policy's tokenizer.json;  TOKENIZER_TYPE hf or char [hf; tiny: char]
#   PROMPT_FILE              JSONL, one {"prompt": "..."} per line
#   OUTPUT_DIR               metrics, memory ledger, TensorBoard, checkpoints [outputs/llama2-MODEL_SIZE-ppo]
#   NNODES, GPUS_PER_NODE    * nodes, and GPUs (processes) per node
#   TP, PP                   * tensor and pipeline parallel sizes (every role: one layout)
#   free_memory_policy, free_memory_reference, free_memory_reward, free_memory_value,
#   free_memory_ppo_policy, free_memory_ppo_value
#                            EMS: True frees the role's device memory while it is idle [True]
#   ROLLOUT_BATCH_SIZE       * prompts per PPO iteration, over all data-parallel ranks
#   TRAIN_GLOBAL_BATCH_SIZE  * samples per optimizer step;  TRAIN_MICRO_BATCH_SIZE *
#   INFERENCE_MICRO_BATCH_SIZE * forward micro-batch of the inference roles
#   GENERATION_BATCH_SIZE    * rows decoded at once per data-parallel rank (bounds the KV cache)
#   ITERATIONS               * PPO iterations;  MAX_PROMPT_LENGTH, MAX_NEW_TOKENS *
#   PRECISION                bf16 or fp32 [bf16; tiny: fp32]
#   GPU_MEMORY               device memory per GPU the dry run checks the plan against [80GiB]
#   MASTER_ADDR, MASTER_PORT rendezvous host and port of a multi-node launch [29500]; RDZV_ID
#   PYTHON                   the interpreter with megatron-rlhf installed [python3]
#   DRY_RUN=1                print the plan and exit;  CHECK_ONLY=1  check the inputs and exit
# Anything else rlhf.yaml reads (KL_COEF, POLICY_LR, VALUE_LR, SAVE_INTERVAL, ...) passes through.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
errors=()
missing=()

# size -> "preset heads kv_groups layers | TP PP NNODES GPUS_PER_NODE | rollout global micro
#          inference_micro generation_batch iterations prompt_len new_tokens"
preset_of() {
  case "$1" in
    tiny) echo "tiny 4 2 2 | 2 1 1 2 | 16 8 2 4 8 20 32 16" ;;
    7b) echo "llama2-7b 32 32 32 | 2 1 1 8 | 512 128 2 8 32 1000 1024 512" ;;
    13b) echo "llama2-13b 40 40 40 | 4 1 1 8 | 512 128 2 8 32 1000 1024 512" ;;
    70b) echo "llama2-70b 64 8 80 | 8 2 4 8 | 512 128 2 8 32 1000 1024 512" ;;
    *) return 1 ;;
  esac
}

MODEL_SIZE=${MODEL_SIZE:-7b}
REWARD_MODEL_SIZE=${REWARD_MODEL_SIZE:-$MODEL_SIZE}
if ! policy_preset=$(preset_of "$MODEL_SIZE"); then
  echo "error: MODEL_SIZE=$MODEL_SIZE: expected one of tiny, 7b, 13b, 70b" >&2
  exit 2
fi
if ! reward_preset=$(preset_of "$REWARD_MODEL_SIZE"); then
  echo "error: REWARD_MODEL_SIZE=$REWARD_MODEL_SIZE: expected one of tiny, 7b, 13b, 70b" >&2
  exit 2
fi
read -r POLICY_PRESET heads kv_groups layers _ d_tp d_pp d_nnodes d_gpus _ d_rollout d_global d_micro \
  d_inference_micro d_generation_batch d_iterations d_prompt_len d_new_tokens <<<"$policy_preset"
read -r REWARD_PRESET reward_heads reward_kv_groups reward_layers _ <<<"$reward_preset"

: "${TP:=$d_tp}" "${PP:=$d_pp}" "${NNODES:=$d_nnodes}" "${GPUS_PER_NODE:=$d_gpus}"
: "${ROLLOUT_BATCH_SIZE:=$d_rollout}" "${TRAIN_GLOBAL_BATCH_SIZE:=$d_global}" "${TRAIN_MICRO_BATCH_SIZE:=$d_micro}"
: "${INFERENCE_MICRO_BATCH_SIZE:=$d_inference_micro}" "${GENERATION_BATCH_SIZE:=$d_generation_batch}"
: "${ITERATIONS:=$d_iterations}" "${MAX_PROMPT_LENGTH:=$d_prompt_len}" "${MAX_NEW_TOKENS:=$d_new_tokens}"
: "${OUTPUT_DIR:=outputs/llama2-$MODEL_SIZE-ppo}" "${GPU_MEMORY:=80GiB}" "${PYTHON:=python3}"
: "${CONFIG:=$HERE/rlhf.yaml}"
if [[ $MODEL_SIZE == tiny ]]; then
  : "${TOKENIZER_TYPE:=char}" "${PRECISION:=fp32}" "${PROMPT_FILE:=$REPO/examples/tiny/prompts.jsonl}"
else
  : "${TOKENIZER_TYPE:=hf}" "${PRECISION:=bf16}"
fi
VALUE_LOAD=${VALUE_LOAD:-${REWARD_LOAD:-}}
ROLES=(policy reference reward value ppo_policy ppo_value)
for role in "${ROLES[@]}"; do
  name=free_memory_$role
  declare "$name=${!name:-True}"
done

# ---- values --------------------------------------------------------------------------------------
INTEGERS=(NNODES GPUS_PER_NODE TP PP ROLLOUT_BATCH_SIZE TRAIN_GLOBAL_BATCH_SIZE TRAIN_MICRO_BATCH_SIZE
  INFERENCE_MICRO_BATCH_SIZE GENERATION_BATCH_SIZE ITERATIONS MAX_PROMPT_LENGTH MAX_NEW_TOKENS)
integers_ok=1
for name in "${INTEGERS[@]}"; do
  if [[ ! ${!name} =~ ^[1-9][0-9]*$ ]]; then
    errors+=("$name=${!name}: expected a whole number >= 1")
    integers_ok=0
  fi
done
for role in "${ROLES[@]}"; do
  name=free_memory_$role
  [[ ${!name,,} =~ ^(true|false)$ ]] || errors+=("$name=${!name}: expected True or False")
done
[[ $PRECISION =~ ^(bf16|fp32)$ ]] || errors+=("PRECISION=$PRECISION: expected bf16 or fp32")
[[ $TOKENIZER_TYPE =~ ^(hf|char)$ ]] || errors+=("TOKENIZER_TYPE=$TOKENIZER_TYPE: expected hf or char")

# ---- sizes that must divide (the same rules megatron_rlhf.config.validation applies) ------------
if ((integers_ok)); then
  world=$((NNODES * GPUS_PER_NODE))
  if ((world % (TP * PP))); then
    errors+=("NNODES*GPUS_PER_NODE = $NNODES*$GPUS_PER_NODE = $world GPUs is not divisible by TP*PP = $TP*$PP")
  else
    dp=$((world / (TP * PP)))
    if ((ROLLOUT_BATCH_SIZE % dp)); then
      errors+=("ROLLOUT_BATCH_SIZE=$ROLLOUT_BATCH_SIZE is not divisible by the data-parallel size $dp (GPUs / (TP*PP))")
    elif (((ROLLOUT_BATCH_SIZE / dp) % INFERENCE_MICRO_BATCH_SIZE)); then
      errors+=("INFERENCE_MICRO_BATCH_SIZE=$INFERENCE_MICRO_BATCH_SIZE does not divide the per-rank rollout of $((ROLLOUT_BATCH_SIZE / dp))")
    fi
    if ((ROLLOUT_BATCH_SIZE % TRAIN_GLOBAL_BATCH_SIZE)); then
      errors+=("TRAIN_GLOBAL_BATCH_SIZE=$TRAIN_GLOBAL_BATCH_SIZE does not divide ROLLOUT_BATCH_SIZE=$ROLLOUT_BATCH_SIZE")
    elif ((TRAIN_GLOBAL_BATCH_SIZE % (TRAIN_MICRO_BATCH_SIZE * dp))); then
      errors+=("TRAIN_GLOBAL_BATCH_SIZE=$TRAIN_GLOBAL_BATCH_SIZE is not divisible by TRAIN_MICRO_BATCH_SIZE*DP = $TRAIN_MICRO_BATCH_SIZE*$dp")
    fi
  fi
  for model in "policy $MODEL_SIZE $heads $kv_groups $layers" "reward $REWARD_MODEL_SIZE $reward_heads $reward_kv_groups $reward_layers"; do
    read -r what size h kv l <<<"$model"
    ((kv % TP == 0)) || errors+=("TP=$TP does not divide the $what model's ($size) $kv key-value heads (of $h attention heads)")
    ((l % PP == 0)) || errors+=("PP=$PP does not divide the $what model's ($size) $l layers")
  done
  ((TP <= GPUS_PER_NODE)) || echo "warning: TP=$TP > GPUS_PER_NODE=$GPUS_PER_NODE: tensor-parallel traffic crosses nodes" >&2
  if ((NNODES > 1)) && [[ -z ${MASTER_ADDR:-} ]]; then
    missing+=("NNODES=$NNODES: a multi-node launch needs MASTER_ADDR, the first node's address (slurm/run_ppo.sbatch sets it)")
  fi
fi

# ---- paths ---------------------------------------------------------------------------------------
absolute() { if [[ $1 == /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
need_checkpoint() { # NAME: a converted model checkpoint, required for the Llama-2 sizes
  local name=$1
  if [[ -z ${!name:-} ]]; then
    [[ $MODEL_SIZE == tiny ]] || missing+=("$name is not set: the directory of a converted checkpoint (tools/convert_hf_to_megatron.py)")
  elif [[ ! -f ${!name}/megatron_rlhf_model.json ]]; then
    missing+=("$name=${!name}: not a converted checkpoint (no megatron_rlhf_model.json); write it with tools/convert_hf_to_megatron.py")
  fi
}
need_file() { # NAME WHAT
  local name=$1
  if [[ -z ${!name:-} ]]; then
    missing+=("$name is not set: $2")
  elif [[ ! -f ${!name} ]]; then
    missing+=("$name=${!name}: no such file ($2)")
  fi
}
need_checkpoint POLICY_LOAD
need_checkpoint REWARD_LOAD
[[ $VALUE_LOAD == "${REWARD_LOAD:-}" ]] || need_checkpoint VALUE_LOAD
[[ $TOKENIZER_TYPE != hf ]] || need_file TOKENIZER "the model's tokenizer.json"
need_file PROMPT_FILE 'JSONL, one {"prompt": "..."} per line'
[[ -f $CONFIG ]] || errors+=("CONFIG=$CONFIG: no such file")
for name in POLICY_LOAD REWARD_LOAD VALUE_LOAD TOKENIZER PROMPT_FILE OUTPUT_DIR CONFIG; do
  # rlhf.yaml reads a relative path relative to itself: pin them to the caller's directory.
  if [[ -n ${!name:-} ]]; then declare "$name=$(absolute "${!name}")"; fi
done

if [[ ${DRY_RUN:-0} == 1 ]]; then
  for m in "${missing[@]}"; do echo "warning: $m (a real launch stops here)" >&2; done
else
  errors+=("${missing[@]}")
fi
if ((${#errors[@]})); then
  printf 'error: %s\n' "${errors[@]}" >&2
  echo "run_ppo.sh: nothing was launched" >&2
  exit 2
fi

export TP PP POLICY_PRESET REWARD_PRESET PRECISION TOKENIZER_TYPE PROMPT_FILE OUTPUT_DIR \
  ROLLOUT_BATCH_SIZE TRAIN_GLOBAL_BATCH_SIZE TRAIN_MICRO_BATCH_SIZE INFERENCE_MICRO_BATCH_SIZE \
  GENERATION_BATCH_SIZE ITERATIONS MAX_PROMPT_LENGTH MAX_NEW_TOKENS
for name in POLICY_LOAD REWARD_LOAD VALUE_LOAD TOKENIZER; do
  if [[ -n ${!name:-} ]]; then export "${name?}"; fi
done
for role in "${ROLES[@]}"; do export "free_memory_$role"; done

if [[ ${DRY_RUN:-0} == 1 ]]; then
  exec "$PYTHON" -m megatron_rlhf.train --config "$CONFIG" --dry-run --world-size "$world" \
    --nproc-per-node "$GPUS_PER_NODE" --gpu-memory "$GPU_MEMORY"
fi
if [[ ${CHECK_ONLY:-0} == 1 ]]; then
  echo "run_ppo.sh: inputs checked: $MODEL_SIZE, $world GPUs (TP=$TP PP=$PP DP=$dp), output $OUTPUT_DIR"
  exit 0
fi

launch=(--nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE")
if [[ -n ${MASTER_ADDR:-} ]]; then
  launch+=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-megatron-rlhf}")
else
  launch+=(--standalone)
fi
echo "run_ppo.sh: $MODEL_SIZE on $world GPUs (TP=$TP PP=$PP DP=$dp) on ${HOSTNAME:-$(uname -n)}, output $OUTPUT_DIR"
exec "$PYTHON" -m torch.distributed.run "${launch[@]}" -m megatron_rlhf.train --config "$CONFIG" "$@"
