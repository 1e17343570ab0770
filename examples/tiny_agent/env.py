"""The agent demo's environment: a game the policy can only win by reading the replies.

Each observation shows a target letter followed by ``>`` (" e>"); the correct move is to answer
with that letter. A move scores 1/TURNS; the targets are drawn from the prompt and the turn, so
a policy that ignores the observations scores at most 1/len(TARGETS) per move on average (always
playing one letter), while one that reads them can score 1."""

import zlib

TARGETS = "aeio"
TURNS = 4


class EchoGame:
    def start(self, row):
        self.prompt = row["prompt"]
        self.turn = 0
        return self._show()

    def _target(self):
        return TARGETS[zlib.crc32(f"{self.prompt}|{self.turn}".encode()) % len(TARGETS)]

    def _show(self):
        return f" {self._target()}>"

    def step(self, turn):
        correct = turn.text[:1] == self._target()
        self.turn += 1
        done = self.turn >= TURNS
        return (None if done else self._show()), done, (1.0 / TURNS if correct else 0.0), {"correct": correct}
