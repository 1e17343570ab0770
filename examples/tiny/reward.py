"""The demo's rule reward: the share of vowels in the response, which a tiny model can learn to
raise. An empty response scores 0."""

VOWELS = set("aeiou")


def vowel_fraction(prompts, responses):
    return [sum(c in VOWELS for c in r) / len(r) if r else 0.0 for r in responses]
