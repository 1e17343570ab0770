import dataclasses

import pytest
import torch

from megatron_rlhf.runtime import megatron_compat, megatron_cpu


def test_every_adaptation_site_matches_the_installed_megatron_core():
    assert megatron_cpu.check_sites() == []


def test_a_moved_site_is_reported_by_name_file_and_lines(monkeypatch):
    first = megatron_cpu.ADAPTATIONS[0]
    moved = dataclasses.replace(first.sites[0], lines=(1, 3))
    monkeypatch.setattr(
        megatron_cpu, "ADAPTATIONS",
        [dataclasses.replace(first, sites=(moved,))] + megatron_cpu.ADAPTATIONS[1:],
    )
    problems = megatron_cpu.check_sites()
    assert len(problems) == 1
    assert problems[0].startswith(f"{first.name}: expected ")
    assert f"megatron/core/{moved.file} lines 1-3" in problems[0]


def test_apply_refuses_to_run_on_changed_internals(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "_applied", False)
    monkeypatch.setattr(megatron_cpu, "check_sites", lambda: ["x: expected 'y' in megatron/core/z.py lines 1-2"])
    with pytest.raises(megatron_compat.MegatronInternalsChanged, match="Re-verify each in megatron_rlhf/runtime/megatron_cpu.py"):
        megatron_cpu.apply()


def test_the_internals_used_on_every_platform_match_and_a_moved_one_is_refused(monkeypatch):
    megatron_compat.check()  # the installed megatron-core: nothing moved
    moved = megatron_compat.Site("optimizer/distrib_optimizer.py", "def _get_model_param_range_map_renamed(")
    monkeypatch.setitem(megatron_compat.ANCHORS, "owned_optimizer_state", (moved,))
    with pytest.raises(megatron_compat.MegatronInternalsChanged) as raised:
        megatron_compat.check()
    assert "owned_optimizer_state: expected 'def _get_model_param_range_map_renamed(' in " \
        "megatron/core/optimizer/distrib_optimizer.py" in str(raised.value)
    assert "Re-verify each in megatron_rlhf/runtime/megatron_compat/optimizer.py" in str(raised.value)


def test_the_device_variable_chooses_the_platform_and_a_bad_value_is_named(monkeypatch):
    from megatron_rlhf.runtime import platform

    def chosen(value):
        monkeypatch.setenv(platform.DEVICE_VARIABLE, value)
        return platform.chosen_device()

    assert chosen("cpu") == chosen(" CPU ") == "cpu"  # the test session's own setting (conftest)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert chosen("") == "cpu"
    with pytest.raises(platform.DeviceChoiceError, match="MEGATRON_RLHF_DEVICE=cuda, but torch sees no CUDA device"):
        chosen("cuda")
    with pytest.raises(platform.DeviceChoiceError, match=r"MEGATRON_RLHF_DEVICE='gpu': must be one of cpu, cuda"):
        chosen("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert chosen("") == "cuda" and chosen("cpu") == "cpu"
