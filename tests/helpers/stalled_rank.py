"""``tests/helpers/stalled_rank.py STEP -- <train's arguments>``, run as each rank of a world (conftest.spawn_ranks):
megatron_rlhf.train's own entry, with rank 1 stalled (a minute, marked "stalled by the test") at the
start of step STEP of any stage: the other ranks wait in their next collective until
trainer.collective_timeout_s."""

import os
import sys
import time

from megatron_rlhf.controller import PPOController
from megatron_rlhf.stages.stage import Stage
from megatron_rlhf.train import main

STALLED_STEP = int(sys.argv[1])


def stalled(step):
    def run(self, iteration):
        if os.environ["RANK"] == "1" and iteration == STALLED_STEP:
            self.role_set.progress.mark("stalled by the test")
            time.sleep(60)
        return step(self, iteration)
    return run


Stage.step, PPOController.step = stalled(Stage.step), stalled(PPOController.step)
main(sys.argv[3:])
