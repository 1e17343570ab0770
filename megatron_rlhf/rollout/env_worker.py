"""An environment worker process (rollout/env_pool.py): ``python -m megatron_rlhf.rollout.env_worker FD SPEC
OPTIONS`` (a file spec absolute; OPTIONS: the JSON keyword arguments of every instance). Loads the environment class, says "ready", then answers each request:
("start", trajectory, row) and ("step", trajectory, Turn fields) with ("ok", result), ("raised",
description) or ("protocol", message); ("close", trajectory) drops an instance, unanswered. Its
standard output goes to standard error: the environment's prints never reach the socket."""

import json
import os
import sys
from multiprocessing.connection import Connection


def main(argv) -> None:
    try:
        _serve(argv)
    except (EOFError, ConnectionError, KeyboardInterrupt):  # the run ended, however: end quietly
        pass


def _serve(argv) -> None:
    fd, spec, options = int(argv[0]), argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    os.dup2(2, 1)
    conn = Connection(fd)
    from megatron_rlhf.rewards.contract import describe, load_reward_function
    from megatron_rlhf.agents.protocol import ProtocolError, Turn, checked_observation, checked_step

    try:
        cls = load_reward_function(spec, os.getcwd(), what="environment")
    except ValueError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", None))
    instances = {}
    while True:
        try:
            kind, trajectory, payload = conn.recv()
        except EOFError:
            return
        if kind == "close":
            instances.pop(trajectory, None)
            continue
        try:
            if kind == "start":
                instances[trajectory] = env = cls(**options)
                result = checked_observation(env.start(payload))
            else:
                result = checked_step(instances[trajectory].step(Turn(**payload)))
            conn.send(("ok", result))
        except ProtocolError as e:
            conn.send(("protocol", str(e)))
        except SystemExit as e:
            conn.send(("raised", f"called sys.exit({e.code!r})"))
        except Exception as e:  # the environment failed on this input: a counted failure
            conn.send(("raised", f"raised {describe(e)}"))


if __name__ == "__main__":
    main(sys.argv[1:])
