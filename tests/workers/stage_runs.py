"""Each stage before RL (examples/tiny_pipeline's sft, rm, dpo; 3 steps, validated) through the
run's own entry (prepare, run_loop.run), plain and with every role's free_memory: auto and
trainer.overlap_onload on: the choices the one run loop makes for every stage. Run with 2 processes."""

import json
import os

from common import OUT_DIR, run_config, runs_in_one_world, save
from tests.workers.findings import StageRuns

PIPELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "tiny_pipeline")
OVERLAP = "trainer:\n  overlap_onload: true\n"

runs_in_one_world()
result = StageRuns(metrics={}, printed={}, auto_choice={})
for stage in ("sft", "rm", "dpo"):
    overlapped = os.path.join(OUT_DIR, f"{stage}_overlap.yaml")
    with open(overlapped, "w") as f:
        f.write(f"includes: {os.path.join(PIPELINE, stage + '.yaml')}\n{OVERLAP}")
    for name, config, free_memory in (("plain", os.path.join(PIPELINE, stage + ".yaml"), "True"),
                                      ("auto_overlap", overlapped, "auto")):
        output = os.path.join(OUT_DIR, f"{stage}_{name}")
        key = f"{stage}:{name}"
        result.metrics[key], result.printed[key] = run_config(config, output, "--iterations", "3",
                                                              FREE_MEMORY=free_memory, TENSORBOARD="False",
                                                              PROGRESS_BAR="False")
    with open(os.path.join(OUT_DIR, f"{stage}_auto_overlap", "free_memory_auto.json")) as f:
        result.auto_choice[stage] = json.load(f)
save(result)
