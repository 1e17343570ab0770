"""Reward-model training and DPO against TRL's RewardTrainer and DPOTrainer on the same work, side by
side in one run, on CPU: pairs per second of optimizer steps.

The work: the pipeline demo's 384 preference pairs (examples/tiny_pipeline/pairs.jsonl, at most 40
tokens a side, the same token ids on both sides: a character tokenizer), steps of 16 pairs, fp32,
Adam at a constant learning rate, gradient clip 1.0. Both start from the same weights: a small Llama
written by transformers (hidden 256, 4 layers; a score head for the reward model), converted for us
by the converter. Ours runs as a user runs it on one machine (2 processes, DP=2, EMS on) and at the
setting matched to TRL's (one process with 2 threads, every role resident, no distributed
optimizer); TRL runs on one process with torch's default threads (the machine's cores). Prints the
median seconds per step after the warm-up, pairs/s and the ratio to TRL.

    pip install -e .[bench]          # TRL, pinned (not a dependency of the project)
    python bench/preference_trl.py [--steps 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
PAIRS = os.path.join(REPO, "examples", "tiny_pipeline", "pairs.jsonl")
ALPHABET = "abcdefghijklmnopqrstuvwxyz "
BATCH, LR = 16, 1e-5
# name -> (processes, threads per process, EMS and optimizer settings)
OURS = {
    "ours, 2 processes (DP=2), EMS on": (2, 1, "free_memory: true\n  use_distributed_optimizer: true"),
    "ours matched: 1 process, 2 threads, resident": (1, 2, "free_memory: false\n  use_distributed_optimizer: false"),
}


def weights(directory: str) -> None:
    """The small Llama both sides start from: a language model (DPO's policy and reference) and the
    same body with a score head (the reward model), written by transformers and converted for us."""
    import torch
    import transformers

    from megatron_rlhf.checkpoint.convert import hf_to_megatron

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=4, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=1)
    for name, cls in (("lm", transformers.LlamaForCausalLM), ("rm", transformers.LlamaForSequenceClassification)):
        torch.manual_seed(0)
        cls(config).save_pretrained(os.path.join(directory, f"{name}_hf"))
        hf_to_megatron(os.path.join(directory, f"{name}_hf"), os.path.join(directory, f"{name}_mg"))


def char_tokenizer(directory: str):
    """A transformers tokenizer with our character tokenizer's ids (pad 0, bos 1, eos 2, the alphabet)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: i + 3 for i, c in enumerate(ALPHABET)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(os.path.join(directory, "tokenizer"))
    return fast


def ours(stage: str, name: str, directory: str, args) -> dict:
    procs, threads, memory = OURS[name]
    role, load = ("reward", "rm_mg") if stage == "rm" else ("policy", "lm_mg")
    config = os.path.join(directory, f"{stage}.yaml")
    with open(config, "w") as f:
        f.write(f"stage: {stage}\ndata:\n  train_file: {PAIRS}\n  tokenizer: {{type: char, alphabet: '{ALPHABET}'}}\n"
                f"{stage}:\n  max_length: 40\n  max_steps: {args.steps}\n"
                "trainer:\n  tensorboard: false\n  progress_bar: false\n  save_at_end: false\n"
                f"{role}:\n  model: {{preset: auto}}\n  load: {os.path.join(directory, load)}\n  precision: fp32\n"
                f"  micro_batch_size: {BATCH // procs}\n  global_batch_size: {BATCH}\n  lr: {LR:.1e}\n  adam_beta2: 0.999\n"
                f"  {memory}\n" + (f"reference:\n  micro_batch_size: {2 * BATCH // procs}\n  "
                                    + memory.splitlines()[0] + "\n" if stage == "dpo" else ""))
    out = os.path.join(directory, f"out_{stage}")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "-m", "megatron_rlhf.train",
               "--config", config, "--overwrite", "--output-dir", out]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode:
        sys.exit(f"{name}: {' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        seconds = [json.loads(line)["time/iteration_s"] for line in f]
    return {"seconds_per_step": statistics.median(seconds[args.skip:]), "processes": procs, "threads": threads}


def trl(stage: str, directory: str, args) -> dict:
    """TRL's trainer on the same pairs, weights and settings; one process, torch's default threads."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    tokenizer = char_tokenizer(directory)
    with open(PAIRS) as f:
        rows = [json.loads(line) for line in f]
    stamps = []

    class Stamps(TrainerCallback):
        def on_step_end(self, *_, **__):
            stamps.append(time.perf_counter())

    common = dict(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, seed=1234, report_to="none",
                  save_strategy="no", logging_steps=1000, per_device_train_batch_size=BATCH, learning_rate=LR,
                  lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=args.steps, dataloader_num_workers=0)
    if stage == "rm":
        ids = lambda text: tokenizer(text)["input_ids"] + [2]  # noqa: E731 (bos, the text, eos: as ours)
        data = Dataset.from_list([{"chosen_ids": ids(r["prompt"] + r["chosen"]), "rejected_ids": ids(r["prompt"] + r["rejected"])}
                                  for r in rows])
        model = AutoModelForSequenceClassification.from_pretrained(os.path.join(directory, "rm_hf"), dtype=torch.float32)
        trainer = RewardTrainer(model=model, args=RewardConfig(**common), train_dataset=data, processing_class=tokenizer,
                                callbacks=[Stamps()])
    else:
        data = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
        model = AutoModelForCausalLM.from_pretrained(os.path.join(directory, "lm_hf"), dtype=torch.float32)
        trainer = DPOTrainer(model=model, args=DPOConfig(beta=0.1, **common), train_dataset=data,
                             processing_class=tokenizer, callbacks=[Stamps()])
    trainer.train()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"seconds_per_step": statistics.median(steps[args.skip - 1:]), "processes": 1, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the median (warm-up)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        weights(directory)
        for stage in ("rm", "dpo"):
            rows = {"TRL " + ("RewardTrainer" if stage == "rm" else "DPOTrainer"): trl(stage, directory, args)}
            rows.update({name: ours(stage, name, directory, args) for name in OURS})
            peer = next(iter(rows.values()))["seconds_per_step"]
            print(f"\n{stage}: {BATCH} pairs a step, {args.steps} steps (median after {args.skip})")
            for name, row in rows.items():
                row["pairs_per_s"] = BATCH / row["seconds_per_step"]
                print(f"  {name:<48} {row['processes']} proc x {row['threads']} thr  {row['seconds_per_step']:.3f} s/step  "
                      f"{row['pairs_per_s']:7.1f} pairs/s  {peer / row['seconds_per_step']:.2f}x TRL's throughput")
            results[stage] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
