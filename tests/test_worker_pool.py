"""The test harness's pool of worker ranks (tests/workers/pool.py): a case finds the process as a
fresh one would, whatever the case before it changed."""


def test_a_case_finds_nothing_an_earlier_case_in_the_same_process_changed(tmp_path):
    from tests.conftest import run_workers

    first = run_workers(tmp_path / "first", 1, "pool_state")[0]
    second = run_workers(tmp_path / "second", 1, "pool_state")[0]
    assert second.pid == first.pid  # the same rank ran both
    assert first.left_behind == [] and second.left_behind == []
