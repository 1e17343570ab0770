"""Models of another parallel layout than the run's, on process groups of their own
(runtime/layouts.py), served the trained model's weights by megatron-core's resharding
(roles/weight_sync.reshard_weights): checked against the trained model's own shards gathered and
cut again by our sharding (models/sharding.py), and by the logits."""

import torch

from megatron_rlhf.models.sharding import shard_state_dict

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def test_a_serving_model_of_another_layout_gets_the_trained_weights_by_resharding(workers):

    ranks = workers(2, "layouts")  # 4 layers; vocabulary 128, padded to 256 (for TP=2) in every layout
    for r in ranks:
        for when in ("start", "changed"):
            full = r.full[when]
            for name, (tp, pp) in {"tp1": (1, 1), "pp2": (1, 2)}.items():
                expected = shard_state_dict(full, 4, 256, tp, 0, pp, r.stages[name])
                got = r.served[(when, name)]
                assert sorted(got) == sorted(expected), (when, name)
                for key, tensor in expected.items():
                    rows = 128 if key in VOCAB_KEYS else None  # the padding rows carry no weights
                    assert torch.equal(got[key][:rows], tensor[:rows]), (when, name, key)
    assert not torch.equal(ranks[0].full["start"]["decoder.layers.0.mlp.linear_fc2.weight"],
                           ranks[0].full["changed"]["decoder.layers.0.mlp.linear_fc2.weight"])
    for r in ranks:  # the TP=1 model computes what the TP=2 one does
        assert (r.logits_tp1[..., :128] - r.logits_trained[..., :128]).abs().max().item() <= 1e-5


def test_serving_roles_at_their_own_layouts_give_the_same_iteration(workers):
    """The must-show of per-role layouts: policy and value at TP=1 (DP=2) served by resharding from
    TP=2 trained roles, the reference at PP=2 loaded from a TP=2 checkpoint, against every role at
    TP=2: the greedy rollout token for token, per-token columns within 1e-5 where they count, one
    iteration's metrics within 1e-5 (greedy and sampled, same streams); EMS on == off bit-exact."""
    for r in workers(2, "role_layouts", timeout=240):
        assert r.mixed["greedy"].layouts == {"policy": (1, 1, 1), "value": (1, 1, 1), "reference": (1, 2, 1),
                                             "ppo_policy": (2, 1, 1), "ppo_value": (2, 1, 1)}
        assert set(r.same["greedy"].layouts.values()) == {(2, 1, 1)}
        # A mixture of experts: the run at EP=2, the policy at EP=1.
        assert r.mixed["moe/greedy"].layouts == {"policy": (1, 1, 1), "reference": (1, 1, 2), "ppo_policy": (1, 1, 2)}
        for mode in ("greedy", "sampled", "moe/greedy", "moe/sampled"):
            same, mixed = r.same[mode].columns, r.mixed[mode].columns
            assert torch.equal(same["tokens"], mixed["tokens"]), mode
            mask = same["action_mask"].bool()
            assert torch.equal(mask, mixed["action_mask"].bool())
            if "routes" in same:  # routing replay's record (from the rollout): every routing alike
                assert torch.equal(same["routes"], mixed["routes"]), mode
            for key in ("old_log_probs", "ref_log_probs", "old_values"):
                if key not in same:
                    continue
                gap = (same[key] - mixed[key])[mask].abs().max().item()
                assert gap <= 1e-5, (mode, key, gap)
            assert torch.equal(same["scores"], mixed["scores"])
            same, mixed = r.same[mode].metrics, r.mixed[mode].metrics
            assert set(same) == set(mixed)
            for key, value in same.items():
                if not key.startswith(("time/", "weight_sync/")):  # the bytes synced depend on the layout
                    assert abs(value - mixed[key]) <= 1e-5, (mode, key, value, mixed[key])
        assert r.resume_resumed == r.resume_whole  # the resumed policy runs the restored weights
        # LoRA, the policy at TP=1: the second iteration's greedy rollout (after an update of the
        # adapters) as at TP=2; after the first sync (the base and the adapters) each moves the adapters alone.
        same, mixed = r.lora["same"], r.lora["mixed"]
        assert mixed.layouts["policy"] == (1, 1, 1) and same.layouts["policy"] == (2, 1, 1)
        assert torch.equal(same.tokens, mixed.tokens)
        mask = same.action_mask.bool()
        assert (same.old_log_probs - mixed.old_log_probs)[mask].abs().max().item() <= 1e-5
        for before, after in zip(same.metrics, mixed.metrics):
            for key, value in before.items():
                if not key.startswith("weight_sync/"):
                    assert abs(value - after[key]) <= 1e-5, (key, value, after[key])
        synced = [m["weight_sync/bytes"] for m in mixed.metrics]
        assert synced == [mixed.bytes["adapters"]] * 2 and synced[0] < mixed.bytes["base"] / 3, synced
        ems_off, ems_on = r.mixed_ems_off, r.mixed["sampled"]
        for key, column in ems_on.columns.items():
            assert torch.equal(column, ems_off.columns[key]), key
        assert {k: v for k, v in ems_on.metrics.items() if not k.startswith("time/")} == \
               {k: v for k, v in ems_off.metrics.items() if not k.startswith("time/")}
