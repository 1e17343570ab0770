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


class SlowEchoGame:
    """The agent demo's game, each trajectory's replies late by 0 to 60 ms (decided by its prompt):
    replies come back in another order than the turns were sent."""

    def __init__(self):
        import importlib.util
        import os

        path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_agent", "env.py")
        spec = importlib.util.spec_from_file_location("tiny_agent_env", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.game = module.EchoGame()

    def start(self, row):
        import zlib

        self.latency = zlib.crc32(row["prompt"].encode()) % 4 * 0.02
        return self.game.start(row)

    def step(self, turn):
        import time

        time.sleep(self.latency)
        return self.game.step(turn)


class UnevenEchoGame:
    """The agent demo's game, over 1 to 4 moves as the prompt decides (a group's trajectories end
    together, the groups at different turns); every reply depends on the moves before it."""

    def __init__(self):
        self.game = SlowEchoGame().game

    def start(self, row):
        import zlib

        self.moves = 1 + zlib.crc32(row["prompt"].encode()) % 4
        self.made = 0
        return self.game.start(row)

    def step(self, turn):
        observation, _, reward, info = self.game.step(turn)
        self.made += 1
        done = self.made >= self.moves
        return (None if done else observation), done, reward, info
