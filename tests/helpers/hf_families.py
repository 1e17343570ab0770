"""Tiny random Hugging Face models of each supported family, their distinctive features on, every
norm and bias moved away from its initial value (so a dropped or misplaced one shows)."""

import json
import os

import torch

# name -> (transformers config class name, model class prefix, config fields beyond the shared ones)
FAMILY_MODELS = {
    "llama3.1": ("LlamaConfig", "Llama", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama3.2": ("LlamaConfig", "Llama", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # Qwen2.5's and Qwen3's long-context setting, YaRN, past an original window of 8 positions (the
    # cases run 12 to 24): its frequencies and the factor on the attention's cosines and sines.
    "qwen2.5": ("Qwen2Config", "Qwen2", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8})),
    "qwen3": ("Qwen3Config", "Qwen3", dict(head_dim=24, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 16.0, "beta_slow": 2.0})),
    "mistral": ("MistralConfig", "Mistral", dict(sliding_window=6)),
}
# Mixtures of experts: 4 experts, 2 per token (3 of 4 without renormalising); one dense layer of two
# where the family has them (Qwen3-MoE's mlp_only_layers, decoder_sparse_step).
MOE_MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3Moe", dict(
        head_dim=24, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[0])),
    "qwen3_moe-unnormed": ("Qwen3MoeConfig", "Qwen3Moe", dict(
        num_experts=4, moe_intermediate_size=32, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("MixtralConfig", "Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2Moe", dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1])),
}
SHARED = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              vocab_size=100, max_position_embeddings=256, rms_norm_eps=1e-5, num_labels=1, pad_token_id=0)


def make_hf_model(name: str, path, head: str = "lm", **overrides):
    """Save a tiny random model of family ``name`` (FAMILY_MODELS) at ``path``; return it (eval)."""
    import transformers

    config_class, prefix, fields = {**FAMILY_MODELS, **MOE_MODELS}[name]
    fields = {"tie_word_embeddings": False, **SHARED, **fields, **overrides}
    config = getattr(transformers, config_class)(**fields)
    cls = getattr(transformers, prefix + ("ForCausalLM" if head == "lm" else "ForSequenceClassification"))
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            moved_from_init = "norm" in name_ or name_.endswith("bias")  # ones and zeros at birth
            p.add_(torch.randn_like(p) * (0.2 if moved_from_init else 0.1))
    model.save_pretrained(path)
    return model


def hf_outputs(model, tokens, head):
    with torch.no_grad():
        if head == "lm":
            return model(tokens).logits
        hidden = model.model(tokens).last_hidden_state
        return model.score(hidden)  # per-token scores, as our scalar head gives them


def assert_outputs_match(models, ranks, layout, last_stage_ranks):
    """Each converted model's outputs at ``layout`` (on the ``last_stage_ranks`` ranks that hold the
    last pipeline stage) within 1e-4 of its transformers model's."""
    for case, (model, head, _) in models.items():
        expected = hf_outputs(model, ranks[0].tokens, head)
        got = [r.outputs[(case, layout)] for r in ranks if (case, layout) in r.outputs]
        assert len(got) == last_stage_ranks, case
        for g in got:
            assert (g - expected).abs().max().item() <= 1e-4, case


def greedy_cases(models, ranks):
    """(case, its transformers model, its end tokens, transformers' greedy rows for the workers'
    prompts) for each LM case, the rows checked to end at spread lengths."""
    prompts, lengths = ranks[0].prompts, ranks[0].lengths
    for case, (model, head, eos) in models.items():
        if head != "lm":
            continue
        with torch.no_grad():
            expected = hf_greedy(model, prompts, lengths, eos)
        assert len({len(r) for r in expected}) > 2, case  # EOS ends rows at spread lengths
        yield case, model, eos, expected


def assert_round_trip(root, models, ranks):
    """Each converted model written back by megatron_to_hf holds the same tensors as the original,
    names its family, and loads in transformers to the same outputs."""
    from megatron_rlhf.checkpoint.convert import megatron_to_hf

    for case, (model, head, _) in models.items():
        back = root / case / "back"
        megatron_to_hf(str(root / case / "mg"), str(back))
        original, written = all_tensors(root / case / "hf"), all_tensors(back)
        assert sorted(written) == sorted(original), case
        assert all(torch.equal(written[k], original[k]) for k in original), case
        config = json.loads((back / "config.json").read_text())
        assert config["model_type"] == model.config.model_type
        assert config["architectures"] == [type(model).__name__]
        reloaded = type(model).from_pretrained(back).eval()
        assert reloaded.config.tie_word_embeddings == model.config.tie_word_embeddings
        tokens = ranks[0].tokens
        assert torch.equal(hf_outputs(reloaded, tokens, head), hf_outputs(model, tokens, head)), case


def all_tensors(directory):
    """Every tensor of a Hugging Face model directory's safetensors files."""
    from safetensors.torch import load_file

    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def hf_greedy(model, prompts, lengths, eos):
    """transformers' greedy responses, each cut after its first end token (``eos``: a list or None)."""
    rows = []
    for row, n in enumerate(lengths):
        out = model.generate(prompts[row : row + 1, :n], attention_mask=torch.ones(1, n, dtype=torch.long),
                             max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)[0, n:].tolist()
        ends = [i for i, t in enumerate(out) if eos and t in eos]
        rows.append(out[: ends[0] + 1] if ends else out)
    return rows


def spread_eos(rows):
    """Two end tokens whose first appearances end the free-running rows at the most distinct
    lengths (two: Llama 3 and Qwen stop on more than one)."""
    def ends(token):
        return len({row.index(token) for row in rows if token in row})

    return sorted(sorted({t for row in rows for t in row}), key=ends, reverse=True)[:2]


def converted_for_equivalence(root, cases, *worker_args):
    """Each (name, head) case's tiny transformers model saved under root/CASE/hf and converted to
    root/CASE/mg (CASE: ``name``, or ``name-head`` where a name comes with both heads), the end
    tokens that spread its greedy rows (LM heads), and the family_equivalence worker's results (2
    processes; ``worker_args`` first). Returns (models: CASE -> (model, head, eos), ranks)."""
    import transformers

    from megatron_rlhf.checkpoint.convert import hf_to_megatron
    from tests.conftest import run_workers

    transformers.logging.set_verbosity_error()
    models, args = {}, []
    prompts = torch.randint(3, 100, (8, 30), generator=torch.Generator().manual_seed(0))
    lengths = [3, 17, 9, 1, 30, 12, 5, 24]  # the worker's
    both_heads = {name for name, _ in cases if sum(n == name for n, _ in cases) > 1}
    for name, head in cases:
        case = f"{name}-{head}" if name in both_heads else name
        model = make_hf_model(name, root / case / "hf", head)
        hf_to_megatron(str(root / case / "hf"), str(root / case / "mg"))
        eos = []
        if head == "lm":
            with torch.no_grad():
                eos = spread_eos(hf_greedy(model, prompts, lengths, None))
        models[case] = (model, head, eos)
        args.append(f"{case}={root / case / 'mg'}:{','.join(map(str, eos))}")
    return models, run_workers(root, 2, "family_equivalence", *worker_args, *args)
