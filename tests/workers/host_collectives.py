"""Every control collective on a host group (runtime/host_groups.py), as NCCL needs it, checked on
the CPU by StrictCollectives through the run's own entry (prepare, then run_loop.run) of: the agent
demo with the policy at a layout of its own (its metrics turned into the run's share) and
background saves; SFT with validation and background saves; and the smoke test. Run with 2
processes on the CPU, and with 1 on a GPU (NCCL: the collectives run as they are, unchecked
there but by NCCL itself)."""

import os

from common import OUT_DIR, StrictCollectives, run_config, runs_in_one_world, save
from tests.workers.findings import HostCollectives

checker = StrictCollectives()  # before megatron_rlhf's modules take torch's functions

from megatron_rlhf import smoke  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
WORLD = int(os.environ["WORLD_SIZE"])
RUNS = {  # name -> (config, environment); with one process (one GPU) the policy has no other layout
    "agent, policy at its own layout": ("examples/tiny_agent/grpo.yaml",
                                        {"TP": "1", "POLICY_TP": "2" if WORLD > 1 else "", "ROLLOUT_BATCH_SIZE": "2"}),
    "sft": ("examples/tiny_pipeline/sft.yaml", {}),
}
BACKGROUND_SAVES = "trainer:\n  save_interval: 1\n  async_save: true\n  progress_bar: false\n  tensorboard: false\n"

runs_in_one_world()
result = HostCollectives(runs=[], violations=checker.violations, host_sites=checker.host_sites, metrics={})
for name, (config, environment) in RUNS.items():
    path = os.path.join(OUT_DIR, name.split(",")[0] + ".yaml")
    with open(path, "w") as f:
        f.write(f"includes: {os.path.join(REPO, config)}\n{BACKGROUND_SAVES}")
    result.metrics[name], _ = run_config(path, os.path.join(OUT_DIR, name.split(",")[0]), "--iterations", "2",
                                         **environment)
    result.runs.append(name)
os.environ["TP"] = "1"  # a layout every world size has (one GPU too)
smoke.main(["--config", os.path.join(REPO, "examples/tiny/rlhf.yaml"), "--steps", "1",
            "--output-dir", os.path.join(OUT_DIR, "smoke")])
result.runs.append("smoke")
result.host_sites = dict(checker.host_sites)
save(result)
