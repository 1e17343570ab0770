"""The stages before RL, each a file of its own over the shared ``Stage`` (stage.py): supervised
fine-tuning (sft.py), reward-model training (rm.py), process reward models (prm.py) and DPO (dpo.py); ``Steps`` (steps.py): what
every stage, RL's included, says to the one run loop (run_loop.py). ``read_rows`` reads a stage's
rows (data/)."""

from __future__ import annotations


def read_rows(config, key: str, tokenizer):
    """The rows of the file at ``key`` (data.train_file or data.val_file) in the stage's shape:
    Demonstrations for sft, PreferencePairs for rm and dpo, StepRows for prm (every row encoded and
    checked)."""
    from megatron_rlhf.data.demonstrations import Demonstrations
    from megatron_rlhf.data.preferences import PreferencePairs
    from megatron_rlhf.data.steps import StepRows

    if config.stage == "prm":
        return StepRows(config.path_of(key), tokenizer, config.prm.max_length, config.prm.step_separator)
    kind = Demonstrations if config.stage == "sft" else PreferencePairs
    return kind(config.path_of(key), tokenizer, config.stage_config.max_length, config.data.apply_chat_template,
                config.data.system_prompt)
