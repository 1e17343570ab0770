"""On CUDA, one model (bf16, TP=1): the engine with its decode steps replayed from CUDA graphs
against the same engine with every step eager (MEGATRON_RLHF_DECODE_GRAPHS=off): greedy and
sampled (temperature, top-p), several cache extents, turns in a kept cache and an open run, a
response resumed mid-way; tokens and behaviour log-probs per run, the replays counted, and the
allocated bytes before and after each run."""

import os
from unittest import mock

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import DecodeGraphsGPU

from megatron_rlhf.generation import CacheSession, OpenRun, SamplingParams, generate
from megatron_rlhf.generation.decode import GRAPHS_VARIABLE
from megatron_rlhf.models.decoder import build_model

parallel = setup(1, 1)
arch = tiny_arch(hidden_size=256, ffn_hidden_size=688, num_attention_heads=8, num_query_groups=4, num_layers=4,
                 vocab_size=1000, max_position_embeddings=256)
model = build_model(arch, parallel, "lm", precision="bf16")
gen = torch.Generator().manual_seed(5)
lengths = torch.randint(4, 40, (24,), generator=gen)
prompts = torch.randint(3, arch.vocab_size, (24, 40), generator=gen)
GREEDY = SamplingParams(max_new_tokens=90, greedy=True, eos_ids=(7,), pad_id=0)  # extents 1..130: five buckets
SAMPLED = SamplingParams(max_new_tokens=90, temperature=0.8, top_p=0.9, eos_ids=(7,), pad_id=0)


def engine_runs():
    runs = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        g = generate(model, prompts, lengths, params, arch.vocab_size, seeds=torch.arange(24) + 11, batch_size=8,
                     record_log_probs=True)
        runs[name] = (g.tokens.cpu(), g.log_probs.cpu(), g.stats.graph_replays)
    # A response resumed after 5 tokens (partial rollouts): its stream draws on from there.
    g = generate(model, prompts[:4], lengths[:4], SAMPLED, arch.vocab_size, seeds=torch.arange(4) + 11,
                 start_counters=[5, 0, 5, 0], record_log_probs=True)
    runs["resumed"] = (g.tokens.cpu(), g.log_probs.cpu(), g.stats.graph_replays)
    # Three turns in a kept cache of 4 slots for 6 rows.
    rows, replays = [prompts[r, : lengths[r]].tolist() for r in range(6)], 0
    with CacheSession(4, 256) as session:
        for turn in range(3):
            width = max(map(len, rows))
            batch = torch.tensor([row + [0] * (width - len(row)) for row in rows])
            g = generate(model, batch, torch.tensor([len(r) for r in rows]), GREEDY, arch.vocab_size,
                         max_new_tokens=[12] * 6, session=session, keys=list(range(6)), record_log_probs=True)
            rows = [t[:n].tolist() + [5, 6] for t, n in zip(g.tokens.cpu(), g.total_lengths.cpu().tolist())]
            replays += g.stats.graph_replays
    runs["turns"] = (torch.tensor([t for row in rows for t in row]), torch.zeros(1), replays)
    # An open run: two rows join while three decode.
    ended = []
    with CacheSession(4, 256) as session, OpenRun(model, SAMPLED, arch.vocab_size, session, record_log_probs=True) as run:
        run.add([0, 1, 2], [prompts[r, : lengths[r]].tolist() for r in range(3)], [30] * 3, torch.arange(3) + 11)
        while len(ended) < 5:
            ended += run.step()
            if ended and run.schedule.lengths.__len__() == 3:
                run.add([3, 4], [prompts[r, : lengths[r]].tolist() for r in (3, 4)], [30] * 2, torch.arange(2) + 20)
    replays = run.stats.graph_replays  # counted as the graphs are released (when the run closes)
    ended.sort(key=lambda e: e[0])
    runs["open"] = (torch.tensor([t for _, tokens, _ in ended for t in tokens]),
                    torch.tensor([p for _, _, lps in ended for p in lps]), replays)
    return runs


def warm_up_capture_stream() -> int:
    """torch captures on one stream of its own; cuBLAS and cuBLASLt take a workspace for it at its
    first GEMM and keep it for the process (as they do for every stream): a library's, not the
    graphs'. Taken here, before the baseline; returns its bytes."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x @ x, x, x[0])  # the libraries' handles: made outside a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.nn.functional.linear(x @ x, x, x[0])  # a cuBLAS GEMM and a cuBLASLt one (bias epilogue)
    del graph, x
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


result = DecodeGraphsGPU.to_fill()
result.capture_stream_workspaces = warm_up_capture_stream()
torch.cuda.synchronize()
first = torch.cuda.memory_allocated()
result.graphed = engine_runs()
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()  # the first runs also made what lives on after them (rotary tables)
engine_runs()
torch.cuda.synchronize()
result.allocated_after = (before, torch.cuda.memory_allocated())
result.first_runs_kept = before - first
with mock.patch.dict(os.environ, {GRAPHS_VARIABLE: "off"}):
    result.eager = engine_runs()
save(result)
