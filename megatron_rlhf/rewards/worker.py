"""A reward worker process (rewards/pool.py): ``python -m megatron_rlhf.rewards.worker FD SPEC...``
(file specs absolute). Loads the reward functions, says "ready", then takes batches of calls (a
list of (function index, prompt, response, fields)) and answers each call of a batch as soon as it
is scored, in order, with ("ok", named scores), ("raised", description), ("contract", message) or
("exit", message): one message to the worker per batch, no round trip per call. Its standard
output goes to standard error: the functions' prints never reach the protocol's socket."""

import os
import sys
from multiprocessing.connection import Connection


def main(argv) -> None:
    try:
        _serve(argv)
    except (EOFError, ConnectionError, KeyboardInterrupt):  # the run ended, however: end quietly
        pass


def _serve(argv) -> None:
    fd, specs = int(argv[0]), argv[1:]
    os.dup2(2, 1)  # prints of the functions go to stderr
    conn = Connection(fd)
    from megatron_rlhf.rewards.contract import ContractError, call, describe, load_reward_function

    try:
        functions = [load_reward_function(spec, os.getcwd()) for spec in specs]
    except ValueError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        for index, prompt, response, fields in batch:
            try:
                conn.send(("ok", call(functions[index], [prompt], [response], [fields])[0]))
            except ContractError as e:
                conn.send(("contract", str(e)))
            except SystemExit as e:
                conn.send(("exit", f"called sys.exit({e.code!r}); a reward must return its scores, not exit"))
                return
            except Exception as e:  # the function failed on this input: a counted failure
                conn.send(("raised", f"raised {describe(e)}"))


if __name__ == "__main__":
    main(sys.argv[1:])
