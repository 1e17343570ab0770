"""GRPO against TRL's GRPOTrainer on the same work, side by side in one run, on CPU (each side on
the same cores at its own best) or on one GPU (``--device cuda``, the GPU kit's grpo step).

The task is `make demo-math`'s (examples/tiny_math/grpo.yaml: its tokenizer and ChatML template, 8
prompts x 8 samples, 6 new tokens, gsm8k + 0.2 x answer_format, 8 optimizer steps of 8 samples per
iteration, the KL to the reference in the loss at 0.001, lr 1e-3, Adam betas (0.9, 0.95), clip
0.2, gradient clip 1.0). Both start from the same weights: a tiny Llama written by transformers,
converted for us by tools/convert_hf_to_megatron.py's converter.

Every row uses all the machine's cores: TRL runs as a user runs it, one process with torch's
default threads (one per core); ours as shipped (TP=1 x DP=2: one process per core, one thread
each), at TP=2, and on one process with a thread per core (EMS on; and matched to TRL: every role
resident, no distributed optimizer). A secondary row keeps the earlier pairing (TRL held to one
thread), labelled so. Prints the processor, each row's processes x threads, seconds per
iteration (median of the steady iterations), start-up (the process's wall time less its
iterations), the ratio to TRL, and the mean reward of the first and last 5 iterations.

On one GPU (``--device cuda``) both sides run one process on the card in bf16 (TRL: its Trainer's
bf16 mixed precision, generation through transformers' ``generate()``): TRL, ours as shipped (EMS
on) and ours matched (every role resident, no distributed optimizer); ``--hidden``, ``--layers``,
``--new-tokens`` and ``--lr`` set a model and responses of a GPU's size (the tokenizer, the data and
every other setting stay the task's).

    pip install -e .[bench]          # TRL, pinned (not a dependency of the project)
    python bench/peer_trl.py [--iterations 30] [--seeds 1 2 3] [--json out.json]
    python bench/peer_trl.py --device cuda --iterations 10 --hidden 1024 --layers 8 --new-tokens 128 --lr 1e-5
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MATH = os.path.join(REPO, "examples", "tiny_math")
TRL_VERSION = "1.16.0"

from machine import cores, processor  # noqa: E402

CORES = cores()
TRL = f"TRL GRPOTrainer, 1 process x {CORES} threads (torch's default)"
TRL_ONE_THREAD = "TRL GRPOTrainer, 1 process x 1 thread (secondary: TRL held to one core)"
# Ours matched to TRL's one process: every role resident, no distributed optimizer.
MATCHED = {"TP": "1", "USE_DISTRIBUTED_OPTIMIZER": "False",
           **{f"free_memory_{r}": "False" for r in ("policy", "reference", "ppo_policy")}}
# name -> (processes, threads per process, environment): each our configuration of the same run.
OURS = {
    f"ours as shipped: TP=1 x DP=2, {CORES} processes x 1 thread, EMS on": (CORES, 1, {}),
    f"ours TP=2, {CORES} processes x 1 thread, EMS on": (CORES, 1, {"TP": str(CORES)}),
    f"ours TP=1, 1 process x {CORES} threads, EMS on": (1, CORES, {"TP": "1"}),
    f"ours matched: 1 process x {CORES} threads, every role resident, no distributed optimizer": (1, CORES, MATCHED),
}


# On one GPU: (processes, threads, environment) of our rows, each one process on the card.
OURS_ON_GPU = {
    "ours as shipped: 1 process on the GPU, bf16, EMS on": (1, 4, {"TP": "1"}),
    "ours matched: 1 process on the GPU, bf16, every role resident, no distributed optimizer": (1, 4, MATCHED),
}
TRL_ON_GPU = "TRL GRPOTrainer, 1 process on the GPU, bf16, generation through transformers"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--skip", type=int, default=3, help="first iterations left out of the median (warm-up)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234], help="run every row once per seed (the run's seed)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--hidden", type=int, default=64, help="the model both sides start from (default: the tiny one)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=6, help="at most, per response (the task's 6 by default)")
    p.add_argument("--lr", type=float, default=1e-3, help="the policy's learning rate (the task's 1e-3 by default)")
    p.add_argument("--trl-child", nargs=2, metavar=("HF_DIR", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--trl-threads", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    return p.parse_args()


def weights(directory: str, args) -> str:
    """The Llama both sides start from (by default our tiny preset's shape), on the math tokenizer's
    ids: hidden // 64 heads (at least 4), a quarter of them (at least 2) for keys and values, an MLP
    of twice the hidden size."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(MATH, "tokenizer"))
    # Every end token the task declares, as our side stops on them: TRL reads the model's.
    with open(os.path.join(MATH, "tokenizer", "generation_config.json")) as f:
        end_tokens = json.load(f)["eos_token_id"]
    heads = max(4, args.hidden // 64)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=heads,
                                      num_key_value_heads=max(2, heads // 4), num_hidden_layers=args.layers, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=end_tokens)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(directory, "hf"))
    from megatron_rlhf.checkpoint.convert import hf_to_megatron

    hf_to_megatron(os.path.join(directory, "hf"), os.path.join(directory, "mg"))
    return os.path.join(directory, "hf")


def ours(name: str, procs: int, threads: int, env: dict, directory: str, seed: int, args) -> dict:
    config = os.path.join(directory, "ours.yaml")
    with open(config, "w") as f:
        f.write(f"includes: {os.path.join(MATH, 'grpo.yaml')}\nseed: {seed}\n"
                f"data:\n  prompt_file: {os.path.join(MATH, 'train.jsonl')}\n  val_file: null\n"
                f"  tokenizer:\n    path: {os.path.join(MATH, 'tokenizer')}\n"
                "trainer:\n  val_before_train: false\n  val_interval: 0\n  tensorboard: false\n  save_at_end: false\n"
                "policy:\n  model:\n    preset: auto\n"  # the architecture of the weights both sides load
                + "".join(f"{role}:\n  load: {os.path.join(directory, 'mg')}\n  model:\n    preset: auto\n"
                          for role in ("reference", "ppo_policy")))
    env = {**env, "MAX_NEW_TOKENS": str(args.new_tokens), "POLICY_LR": str(args.lr)}
    if args.device == "cuda":
        env.update(MEGATRON_RLHF_DEVICE="cuda", PRECISION="bf16")
    out = os.path.join(directory, "out")
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "-m", "megatron_rlhf.train",
               "--config", config, "--overwrite", "--output-dir", out, "--iterations", str(args.iterations)]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads), **env})
    wall = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"{name}: {' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    seconds = [r["time/iteration_s"] for r in rows]
    phases = {k: statistics.median(r[k] for r in rows[args.skip:]) for k in rows[-1] if k.startswith("time/")}
    return {"seconds_per_iteration": statistics.median(seconds[args.skip:]), "start_up_s": wall - sum(seconds),
            "rewards": [r["reward/mean"] for r in rows], "phase_seconds": phases}


def run_trl(hf_dir: str, args) -> dict:
    """TRL's GRPOTrainer on the same data, template, rewards and settings, one process."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rlhf.rewards.verifiers import answer_format, gsm8k

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    threads = torch.get_num_threads()
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
        output_dir=tempfile.mkdtemp(), use_cpu=args.device == "cpu", seed=args.seed, report_to="none", save_strategy="no", logging_steps=8,
        per_device_train_batch_size=8, steps_per_generation=8, gradient_accumulation_steps=1, num_generations=8,
        num_iterations=1, max_completion_length=args.new_tokens, temperature=1.0, beta=0.001, epsilon=0.2, loss_type="dapo",
        learning_rate=args.lr, adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="constant",
        reward_weights=[1.0, 0.2], max_steps=8 * args.iterations, dataloader_num_workers=0,
        **({"bf16": True} if args.device == "cuda" else {}))
    trainer = GRPOTrainer(model=hf_dir, reward_funcs=[gsm8k_reward, format_reward], args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(os.path.join(MATH, "tokenizer")),
                          callbacks=[Stamps()])
    trainer.train()
    iterations = [stamps[i + 7] - (stamps[i - 1] if i else began[0]) for i in range(0, len(stamps), 8)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"seconds_per_iteration": statistics.median(iterations[args.skip:]), "iterations_s": sum(iterations),
            "rewards": rewards, "threads": threads}


def trl_process(hf_dir: str, directory: str, threads, seed: int, args) -> dict:
    """run_trl in a process of its own (start-up measured as ours is: the whole process's wall
    time less its iterations); ``threads`` None: torch's default, as a user runs it."""
    out = os.path.join(directory, "trl.json")
    command = [sys.executable, os.path.abspath(__file__), "--iterations", str(args.iterations), "--skip", str(args.skip),
               "--seed", str(seed), "--device", args.device, "--new-tokens", str(args.new_tokens), "--lr", str(args.lr),
               "--trl-child", hf_dir, out]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        command += ["--trl-threads", str(threads)]
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if proc.returncode:
        sys.exit(f"TRL: {' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    result["start_up_s"] = wall - result.pop("iterations_s")
    return result


def gpu_name() -> str:
    import torch

    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"


def _mean(runs: list, key: str) -> float:
    return statistics.mean(r[key] for r in runs)


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
        hf_dir = weights(directory, args)
        on_gpu = args.device == "cuda"
        peer_name = TRL_ON_GPU if on_gpu else TRL
        for seed in args.seeds:
            results.setdefault(peer_name, []).append(trl_process(hf_dir, directory, None, seed, args))
            if not on_gpu:
                results.setdefault(TRL_ONE_THREAD, []).append(trl_process(hf_dir, directory, 1, seed, args))
            for name, (procs, threads, env) in (OURS_ON_GPU if on_gpu else OURS).items():
                results.setdefault(name, []).append(ours(name, procs, threads, env, directory, seed, args))
    peer = _mean(results[peer_name], "seconds_per_iteration")
    where = gpu_name() if args.device == "cuda" else f"{processor()}, {CORES} cores"
    print(f"{where}; model h{args.hidden} x {args.layers} layers, up to {args.new_tokens} new tokens, lr {args.lr}; "
          f"{args.iterations} iterations each, median of iterations "
          f"{args.skip + 1}-{args.iterations}, seeds {args.seeds} (means over seeds)\n")
    print(f"| run | s / iteration | vs {'TRL' if args.device == 'cuda' else 'TRL (default threads)'} | start-up s | "
          "mean reward first 5 -> last 5 |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        first = statistics.mean(sum(r["rewards"][:5]) / 5 for r in runs)
        last = statistics.mean(sum(r["rewards"][-5:]) / 5 for r in runs)
        seconds = _mean(runs, "seconds_per_iteration")
        print(f"| {name} | {seconds:.3f} | {seconds / peer:.2f}x | {_mean(runs, 'start_up_s'):.1f} | "
              f"{first:.3f} -> {last:.3f} |")
    for name, runs in results.items():  # where our iterations go (the metrics' time/ keys, medians)
        if "phase_seconds" in runs[0]:
            print(f"{name}: " + ", ".join(f"{k[5:]} {_mean([r['phase_seconds'] for r in runs], k):.3f}"
                                          for k in runs[0]["phase_seconds"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
