"""Rule rewards: the function contract (contract.py), the pool of worker processes that calls the
functions with a time-out (pool.py, worker.py: the worker imports no torch, so this package's
__init__ imports nothing) and the built-in verifiers (verifiers.py)."""
