#!/usr/bin/env bash
# PPO (or GRPO) with megatron-rlhf for every supported family (Llama 2/3, Qwen2.5, Qwen3, Mistral:
# docs/guide/models-and-layouts.md, examples/families.md), configured from environment variables. On one node:
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
# slurm/run_ppo.sbatch. Every input is checked before anything is launched, by megatron_rlhf.launch
# (the MODEL_SIZE defaults and the launch checks) and the config's own validation.
#
# Variables (default in brackets; MODEL_SIZE sets the ones marked *; those marked + are the recipe's,
# which MODEL_SIZE=tiny alone sets, for its tiny model):
#   MODEL_SIZE               policy preset: 7b, 13b, 70b (Llama-2), llama3.1-8b, llama3.1-70b, qwen2.5-7b,
#                            qwen2.5-32b, qwen2.5-72b, qwen3-8b, qwen3-32b, the mixtures of experts
#                            qwen3-30b-a3b, mixtral-8x7b, qwen3-235b-a22b (planned only), or tiny (a random
#                            tiny model, to check a cluster's set-up end to end; needs no checkpoint or tokenizer),
#                            or auto: the architecture (and TP/PP) of the converted POLICY_LOAD, any size [7b]
#   REWARD_MODEL_SIZE        reward/value size [MODEL_SIZE]
#   POLICY_LOAD              converted SFT checkpoint (tools/convert_hf_to_megatron.py): reference, ppo_policy;
#                            sft: the base model; dpo: the SFT policy (also the reference)
#   REWARD_LOAD              converted reward model (score head): reward; rm: its starting point, a reward
#                            model or the SFT policy (its body, with a new score head)
#   VALUE_LOAD               starting point of the value model [REWARD_LOAD]
#   TOKENIZER                the policy's Hugging Face directory (tokenizer files, chat template,
#                            generation_config.json) or tokenizer.json;  TOKENIZER_TYPE hf or char [hf; tiny: char]
#   EOS_TOKEN                * one more end token [none; Llama 3: <|eot_id|>; Qwen: <|im_end|>]
#   APPLY_CHAT_TEMPLATE      render prompts (or {"messages": [...]} rows) with the chat template [False]
#   VAL_FILE                 validation prompts (with trainer.val_interval); VAL_BEFORE_TRAIN [the recipe's]
#   PROMPT_FILE              JSONL ({"prompt": "..."} or {"messages": [...]} per line) or Parquet
#   OUTPUT_DIR               metrics, memory ledger, TensorBoard, checkpoints [outputs/PRESET-ppo]
#   NNODES, GPUS_PER_NODE    * nodes, and GPUs (processes) per node
#   TP, PP, EP               * tensor, pipeline and expert parallel sizes (the trained roles' layout)
#   ROLLOUT_TP, ROLLOUT_PP, ROLLOUT_EP  the policy's own layout for generation and old log-probs [the run's]
#   free_memory_policy, free_memory_reference, free_memory_reward, free_memory_value,
#   free_memory_ppo_policy, free_memory_ppo_value
#                            EMS: True frees the role's device memory while it is idle; auto: at start-up,
#                            the fewest switches that make the plan fit the GPU (nothing moves if all fits) [auto]
#   ROLLOUT_BATCH_SIZE       + prompts per PPO iteration, over all data-parallel ranks
#   TRAIN_GLOBAL_BATCH_SIZE  + samples per optimizer step;  TRAIN_MICRO_BATCH_SIZE +
#   INFERENCE_MICRO_BATCH_SIZE + forward micro-batch of the inference roles
#   GENERATION_BATCH_SIZE    + rows decoded at once per data-parallel rank (bounds the KV cache) [32]
#   ITERATIONS               + PPO iterations;  MAX_PROMPT_LENGTH, MAX_NEW_TOKENS +
#   PRECISION                bf16 or fp32 [bf16; tiny: fp32]
#   GPU_MEMORY               device memory per GPU the dry run checks the plan against [80GiB]
#   MASTER_ADDR, MASTER_PORT rendezvous host and port of a multi-node launch [29500]; RDZV_ID
#   PYTHON                   the interpreter with megatron-rlhf installed [the repository's .venv, else python3]
#   STAGE                    rl (PPO and its kin), or a stage before it: sft (demonstrations -> policy),
#                            rm (preference pairs -> reward model), dpo (preference pairs -> policy);
#                            docs/guide/preferences.md [rl]
#   TRAIN_FILE               sft, rm, dpo: the training rows (JSONL or Parquet); VAL_FILE their held-out rows
#   EPOCHS, MAX_LENGTH       sft, rm, dpo: passes over TRAIN_FILE; prompt + response tokens of a row
#   BETA, DPO_LOSS, REFERENCE_LOGPS  dpo: beta, sigmoid or ipo, per_step or precompute
#   CONFIG                   the top config [STAGE's recipe: rlhf.yaml (PPO; grpo.yaml: GRPO, no critic),
#                            sft.yaml, rm.yaml, dpo.yaml]
#   DRY_RUN=1                print the plan and exit;  CHECK_ONLY=1  check the inputs and exit
#   MOE_AUX_LOSS_COEFF, MOE_Z_LOSS_COEFF  router losses of a mixture of experts in training [0: off]
#   ROUTING_REPLAY           off, rollout or old_logprob (docs/guide/models-and-layouts.md) [off]
#   LORA_RANK                LoRA adapters of this rank on ppo_policy instead of full training; the
#                            reference is then the base (docs/guide/lora.md); set POLICY_LR for them [0: off]
#   LOAD_LORA                a PEFT adapter directory the adapters start from (its rank: LORA_RANK)
# Anything else rlhf.yaml reads (KL_COEF, POLICY_LR, VALUE_LR, SAVE_INTERVAL, ...) passes through.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"

# The interpreter: $PYTHON, else the one `make install` / `make demo` created, else python3.
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
# torch found, not imported: the checks and plans below need it only once a run starts (a second saved).
if ! "$PYTHON" -c 'import importlib.util, sys, megatron_rlhf; sys.exit(importlib.util.find_spec("torch") is None)' \
    >/dev/null 2>&1; then
  echo "error: PYTHON=$PYTHON cannot import megatron_rlhf and torch; run 'make install' in $REPO," \
    "or set PYTHON to the interpreter where megatron-rlhf is installed" >&2
  echo "run_ppo.sh: nothing was launched" >&2
  exit 2
fi
exec "$PYTHON" -m megatron_rlhf.launch --name run_ppo.sh ${CONFIG:+--config "$CONFIG"} --recipes "$HERE" -- "$@"
