"""Environments the multi-turn tests name (agents/protocol.py's protocol)."""


class Silent:
    """Never answers: no first observation, and the first step ends the trajectory."""

    def start(self, row):
        return None

    def step(self, turn):
        return None, True, None, {}


class RaisesOnRankOne:
    """Answers like Silent on rank 0; on rank 1 (its workers inherit the launcher's RANK) every step
    raises: that rank's trajectories fail, the batch does not."""

    def start(self, row):
        return None

    def step(self, turn):
        import os

        if os.environ.get("RANK") == "1":
            raise RuntimeError("no such move on rank 1")
        return None, True, None, {}


class RaisesAlways:
    def start(self, row):
        return None

    def step(self, turn):
        raise RuntimeError("the game is broken")
