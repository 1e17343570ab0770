"""Collecting the experience: the typed rollout records (record.py), the collector (collector.py),
scoring (scoring.py), validation (validation.py), sample rows and their cuts (rows.py), and
multi-turn rollouts with environments (environment.py, env_pool.py, env_worker.py, trajectory.py,
multiturn.py), partial rollouts (partial.py)."""
