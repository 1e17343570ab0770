"""The stages before RL, each a loop file of its own over the shared run (runner.py): supervised
fine-tuning (sft.py), reward-model training (rm.py) and DPO (dpo.py). ``stage_class(name)`` is the
one dispatch of the config's ``stage``; ``read_rows`` reads a stage's rows (data/)."""

from __future__ import annotations

from megatron_rlhf.config.names import STAGES


def stage_class(name: str) -> type:
    from megatron_rlhf.config.names import registry
    from megatron_rlhf.stages.dpo import DPOStage
    from megatron_rlhf.stages.rm import RewardModelStage
    from megatron_rlhf.stages.sft import SFTStage

    loops = registry(tuple(s for s in STAGES if s != "rl"), "stage",
                     {"sft": SFTStage, "rm": RewardModelStage, "dpo": DPOStage})
    return loops[name]


def read_rows(config, key: str, tokenizer):
    """The rows of the file at ``key`` (data.train_file or data.val_file) in the stage's shape:
    Demonstrations for sft, PreferencePairs for rm and dpo (every row encoded and checked)."""
    from megatron_rlhf.data.demonstrations import Demonstrations
    from megatron_rlhf.data.preferences import PreferencePairs

    kind = Demonstrations if config.stage == "sft" else PreferencePairs
    return kind(config.path_of(key), tokenizer, config.stage_config.max_length, config.data.apply_chat_template,
                config.data.system_prompt)
