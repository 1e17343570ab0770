"""GRPO against TRL's GRPOTrainer on the same work, side by side in one run, on CPU.

The task is `make demo-math`'s (examples/tiny_math/grpo.yaml: its tokenizer and ChatML template, 8
prompts x 8 samples, 6 new tokens, gsm8k + 0.2 x answer_format, 8 optimizer steps of 8 samples per
iteration, the KL to the reference in the loss at 0.001, lr 1e-3, Adam betas (0.9, 0.95), clip
0.2, gradient clip 1.0). Both start from the same weights: a tiny Llama written by transformers,
converted for us by tools/convert_hf_to_megatron.py's converter. Ours runs in several
configurations (the demo as shipped: TP=1 x DP=2 over two processes; TP=2 over them; TP=1 on one
process; and the setting matched to TRL's: one process, every role resident, no distributed optimizer); TRL runs on one process.
Prints seconds per iteration (median of the steady iterations), start-up, the ratio to TRL, and
the mean reward of the first and last 5 iterations of each.

    pip install -e .[bench]          # TRL, pinned (not a dependency of the project)
    python bench/peer_trl.py [--iterations 30] [--json out.json]
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
MATH = os.path.join(REPO, "examples", "tiny_math")
TRL_VERSION = "1.16.0"

# name -> (processes, environment): each our configuration of the same run.
OURS = {
    "demo as shipped (TP=1 x DP=2 over 2 processes, EMS on)": (2, {}),
    "TP=2 over 2 processes, EMS on": (2, {"TP": "2"}),
    "TP=1, one process, EMS on": (1, {"TP": "1"}),
    "matched: TP=1, one process, every role resident, no distributed optimizer":
        (1, {"TP": "1", "USE_DISTRIBUTED_OPTIMIZER": "False", **{f"free_memory_{r}": "False" for r in
                                                                   ("policy", "reference", "ppo_policy")}}),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--skip", type=int, default=3, help="first iterations left out of the median (warm-up)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--trl-child", nargs=2, metavar=("HF_DIR", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args()


def weights(directory: str) -> str:
    """The tiny Llama both sides start from (our tiny preset's shape, the math tokenizer's ids)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(MATH, "tokenizer"))
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(directory, "hf"))
    from megatron_rlhf.checkpoint.convert import hf_to_megatron

    hf_to_megatron(os.path.join(directory, "hf"), os.path.join(directory, "mg"))
    return os.path.join(directory, "hf")


def ours(name: str, procs: int, env: dict, directory: str, args) -> dict:
    config = os.path.join(directory, "ours.yaml")
    with open(config, "w") as f:
        f.write(f"includes: {os.path.join(MATH, 'grpo.yaml')}\n"
                f"data:\n  prompt_file: {os.path.join(MATH, 'train.jsonl')}\n  val_file: null\n"
                f"  tokenizer:\n    path: {os.path.join(MATH, 'tokenizer')}\n"
                "trainer:\n  val_before_train: false\n  val_interval: 0\n  tensorboard: false\n  save_at_end: false\n"
                + "".join(f"{role}:\n  load: {os.path.join(directory, 'mg')}\n" for role in ("reference", "ppo_policy")))
    out = os.path.join(directory, "out")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "-m", "megatron_rlhf.train",
               "--config", config, "--overwrite", "--output-dir", out, "--iterations", str(args.iterations)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    wall = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"{name}: {' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    seconds = [r["time/iteration_s"] for r in rows]
    return {"seconds_per_iteration": statistics.median(seconds[args.skip:]), "start_up_s": wall - sum(seconds),
            "rewards": [r["reward/mean"] for r in rows]}


def run_trl(hf_dir: str, args) -> dict:
    """TRL's GRPOTrainer on the same data, template, rewards and settings, one process."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rlhf.rewards.verifiers import answer_format, gsm8k

    torch.set_num_threads(1)
    with open(os.path.join(MATH, "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    dataset = Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])

    def texts(completions):
        return [c[-1]["content"] if isinstance(c, list) else c for c in completions]

    def gsm8k_reward(prompts, completions, ground_truth, **_):
        return gsm8k(prompts, texts(completions), ground_truth)

    def format_reward(prompts, completions, **_):
        return answer_format(prompts, texts(completions))

    stamps, began = [], []

    class Stamps(TrainerCallback):
        def on_train_begin(self, *_, **__):
            began.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            stamps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=1234, report_to="none", save_strategy="no", logging_steps=8,
        per_device_train_batch_size=8, steps_per_generation=8, gradient_accumulation_steps=1, num_generations=8,
        num_iterations=1, max_completion_length=6, temperature=1.0, beta=0.001, epsilon=0.2, loss_type="dapo",
        learning_rate=1e-3, adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="constant",
        reward_weights=[1.0, 0.2], max_steps=8 * args.iterations, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=hf_dir, reward_funcs=[gsm8k_reward, format_reward], args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(os.path.join(MATH, "tokenizer")),
                          callbacks=[Stamps()])
    trainer.train()
    iterations = [stamps[i + 7] - (stamps[i - 1] if i else began[0]) for i in range(0, len(stamps), 8)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"seconds_per_iteration": statistics.median(iterations[args.skip:]), "iterations_s": sum(iterations),
            "rewards": rewards}


def trl_process(hf_dir: str, directory: str, args) -> dict:
    """run_trl in a process of its own (start-up measured as ours is: the whole process's wall
    time less its iterations)."""
    out = os.path.join(directory, "trl.json")
    command = [sys.executable, os.path.abspath(__file__), "--iterations", str(args.iterations), "--skip", str(args.skip),
               "--trl-child", hf_dir, out]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"TRL: {' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    result["start_up_s"] = wall - result.pop("iterations_s")
    return result


def main():
    args = parse_args()
    warnings.filterwarnings("ignore")
    if args.trl_child:
        with open(args.trl_child[1], "w") as f:
            json.dump(run_trl(args.trl_child[0], args), f)
        return
    try:
        import trl
    except ImportError:
        sys.exit(f"bench/peer_trl.py needs TRL {TRL_VERSION}: pip install -e .[bench]")
    if trl.__version__ != TRL_VERSION:
        print(f"note: TRL {trl.__version__} installed; the figures in docs/benchmarks.md are of {TRL_VERSION}")
    if not os.path.exists(os.path.join(MATH, "train.jsonl")):
        subprocess.run([sys.executable, os.path.join(MATH, "make_data.py")], check=True)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        hf_dir = weights(directory)
        results["TRL GRPOTrainer, one process"] = trl_process(hf_dir, directory, args)
        for name, (procs, env) in OURS.items():
            results[name] = ours(name, procs, env, directory, args)
    peer = results["TRL GRPOTrainer, one process"]["seconds_per_iteration"]
    print(f"{args.iterations} iterations each, median of iterations {args.skip + 1}-{args.iterations}, "
          f"{os.cpu_count()} cores, OMP_NUM_THREADS=1\n")
    print("| run | s / iteration | vs TRL | start-up s | mean reward first 5 -> last 5 |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        first, last = sum(r["rewards"][:5]) / 5, sum(r["rewards"][-5:]) / 5
        print(f"| {name} | {r['seconds_per_iteration']:.3f} | {r['seconds_per_iteration'] / peer:.2f}x | "
              f"{r['start_up_s']:.1f} | {first:.3f} -> {last:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
