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
            full = r[f"{when}/full"]
            for name, (tp, pp) in {"tp1": (1, 1), "pp2": (1, 2)}.items():
                expected = shard_state_dict(full, 4, 256, tp, 0, pp, r[f"{name}/stage"])
                got = r[f"{when}/{name}"]
                assert sorted(got) == sorted(expected), (when, name)
                for key, tensor in expected.items():
                    rows = 128 if key in VOCAB_KEYS else None  # the padding rows carry no weights
                    assert torch.equal(got[key][:rows], tensor[:rows]), (when, name, key)
    assert not torch.equal(ranks[0]["start/full"]["decoder.layers.0.mlp.linear_fc2.weight"],
                           ranks[0]["changed/full"]["decoder.layers.0.mlp.linear_fc2.weight"])
    for r in ranks:  # the TP=1 model computes what the TP=2 one does
        assert (r["logits/tp1"][..., :128] - r["logits/trained"][..., :128]).abs().max().item() <= 1e-5
