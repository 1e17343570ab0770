"""Rule rewards the worker scripts name by file (a reward pool's workers import this file only)."""


def signal_after_n(prompts, responses):
    """Every response to a prompt before 'n' scores the same (no signal); the others differ."""
    return [0.5 if p < "n" else float(sum(map(ord, r))) for p, r in zip(prompts, responses)]


def first_number(prompts, responses, judged_response):
    """A judge's parser function: the verdict's first number if within [0, 9] (what the number parser
    reads with score_range [0, 9], written again here), NaN otherwise; it checks the judged response is given."""
    import re

    assert len(judged_response) == len(responses) and all(isinstance(r, str) for r in judged_response)
    found = [re.search(r"-?\d+(?:\.\d+)?", verdict) for verdict in responses]
    numbers = [float(m.group()) if m else float("nan") for m in found]
    return [x if 0 <= x <= 9 else float("nan") for x in numbers]
