"""The agent demo's trajectory reward: the environment's per-turn rewards are the whole score
(agents/protocol.py adds them to this), so the outcome adds nothing."""


def no_outcome(prompts, responses):
    return [0.0 for _ in responses]
