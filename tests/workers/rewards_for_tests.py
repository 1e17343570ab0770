"""Rule rewards the worker scripts name by file (a reward pool's workers import this file only)."""


def signal_after_n(prompts, responses):
    """Every response to a prompt before 'n' scores the same (no signal); the others differ."""
    return [0.5 if p < "n" else float(sum(map(ord, r))) for p, r in zip(prompts, responses)]
