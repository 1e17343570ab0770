"""Our process reward model's loss on a converted tiny reward model (1 process): per case (prm
settings), the training loss of one batch of every row and every parameter's gradient under its
Hugging Face name, then the validation figures (every step labelled), for the test to hold against
TRL's PRMTrainer. Args: REWARD_DIR TOKENIZER_DIR ROWS_FILE CASES_JSON."""

import dataclasses
import json

import torch
from common import ARGS, hf_grads, save, setup
from tests.workers.findings import PRMLosses

from megatron_rlhf.checkpoint import load_model_shard
from megatron_rlhf.checkpoint.model_files import read_model_meta
from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.data.steps import StepRows
from megatron_rlhf.data.tokenizer import HFTokenizer
from megatron_rlhf.models.decoder import build_model, load_local_state_dict
from megatron_rlhf.models.pipeline import model_forward
from megatron_rlhf.stages.batches import step_micro_batches
from megatron_rlhf.stages.losses import MEANS, prm_loss_fn

reward_dir, tokenizer_dir, rows_file, cases = ARGS
parallel = setup(1, 1)
arch, meta = read_model_meta(reward_dir)
model = build_model(arch, parallel, "scalar")
load_local_state_dict(model, load_model_shard(reward_dir, arch, "scalar", 1, 0, 1, 0))
tokenizer = HFTokenizer(tokenizer_dir)
result = PRMLosses(cases={})
for name, settings in json.loads(cases).items():
    rows = StepRows(rows_file, tokenizer, settings["max_length"], settings["step_separator"])
    whole = dataclasses.replace(RoleConfig(), micro_batch_size=len(rows))
    found = {"ids": [r.ids for r in rows.rows]}
    for training in (True, False):
        mb = step_micro_batches(whole, rows.rows, False, tokenizer.pad_id, "cpu",
                                training and settings["train_on_last_step_only"])[0]
        model.zero_grad()
        loss_sum, count, metrics = prm_loss_fn()(model_forward(model, mb), mb)
        figures = {k: float(v) / float(metrics[MEANS[k]]) for k, v in metrics.items() if k in MEANS}
        prefix = "" if training else "val_"
        found[prefix + "loss"], found[prefix + "step_accuracy"] = figures["loss"], figures["step_accuracy"]
        if training:
            (loss_sum / count).backward()
            found["grads"] = hf_grads(model, arch, "scalar")
    result.cases[name] = found
save(result)
