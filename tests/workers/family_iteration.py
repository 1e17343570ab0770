"""One PPO iteration of the tiny demo (2 processes, TP=2) per model family, with every role's
features set as the family's (tied embeddings, QKV bias, q/k norm with head_dim 24, a sliding
window, llama3 RoPE scaling), EMS on and off: the metrics and the trained weights, per family."""

import copy
import os

from common import OUT_DIR, reward_pool, save
from tests.workers.findings import EMSOnAndOff, FamilyIteration, Iteration

from megatron_rlhf.config.families import FAMILIES
from megatron_rlhf.config.schema import EMS_SWITCHES
from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.decoder import local_state_dict
from megatron_rlhf.runtime import init_distributed
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

FEATURES = {
    "llama3.1": dict(family="llama", rotary_base=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                     rope_original_max_position_embeddings=32),
    "qwen2.5": dict(family="qwen2", tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", head_dim=24),
    "mistral": dict(family="mistral", sliding_window=6),
}
os.environ.update(TP="2", ITERATIONS="1", ROLLOUT_BATCH_SIZE="8", MAX_NEW_TOKENS="12")
prepared = prepare(parse_args(["--config", "examples/tiny/rlhf.yaml", "--output-dir", OUT_DIR]), int(os.environ["WORLD_SIZE"]))
init_distributed(prepared.config.parallel, seed=prepared.config.seed)
scorer = reward_pool(prepared.reward_functions)


def run(features: dict, ems: bool) -> Iteration:
    config = copy.deepcopy(prepared.config)
    for name in config.model_roles:
        role = config.role(name)
        for key, value in {**features, **FAMILIES[features["family"]].fixed}.items():
            setattr(role.model, key, value)
        role.free_memory = ems
        for switch in EMS_SWITCHES:
            setattr(role, switch, None)
    controller = PPOController(config, copy.deepcopy(prepared.dataset), prepared.tokenizer, scorer, MemoryLedger(None))
    metrics = {k: v for k, v in controller.step().items() if not k.startswith("time/")}
    weights = {}
    for name in config.trainable_roles:
        role = controller.roles[name]
        with role.resident("training"):
            weights[name] = {k: v.detach().clone() for k, v in local_state_dict(role.model).items()}
    return Iteration(metrics=metrics, weights=weights)


save(FamilyIteration(families={family: EMSOnAndOff(on=run(features, True), off=run(features, False))
                               for family, features in FEATURES.items()}))
