"""Environments the multi-turn tests name (rollout/environment.py's protocol)."""


class Silent:
    """Never answers: no first observation, and the first step ends the trajectory."""

    def start(self, row):
        return None

    def step(self, turn):
        return None, True, None, {}
