"""Does a row's result depend on the rows beside it? torch's linear layer on this machine, plain and
in fixed blocks of rows (issue 70's question), with the cost of each, in one run.

For each dtype: one weight [N, K] and rows of random inputs. A row computed alone is compared bit for
bit with the same row computed beside 1..63 others (at the first and the last position), plainly
(``F.linear`` on all rows at once) and in blocks of ``--block`` rows (the rows padded to a multiple
of it, each block one ``F.linear`` of exactly that many rows). Then the time of each way at 1, 16
and 512 rows (the median of ``--repeats``).

    python bench/batch_invariance.py [--k 1024 --n 2816] [--block 16 64] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

COMPANY = (1, 6, 7, 15, 16, 62, 63)  # rows beside the row


def blocked(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.shape[0] % block
    padded = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    return torch.cat([F.linear(padded[i : i + block], weight) for i in range(0, padded.shape[0], block)])[: x.shape[0]]


def varies(linear, rows: torch.Tensor) -> int:
    """How many of the company sizes change the row's result (first or last in the batch)."""
    alone = linear(rows[:1])
    changed = 0
    for others in COMPANY:
        first = linear(rows[: others + 1])[:1]
        last = linear(torch.cat([rows[1 : others + 1], rows[:1]]))[-1:]
        changed += not (torch.equal(first, alone) and torch.equal(last, alone))
    return changed


def timed_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=2816)
    p.add_argument("--block", type=int, nargs="+", default=[16, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    print(f"torch {torch.__version__}, weight [{args.n}, {args.k}], company sizes {COMPANY}")
    print("| dtype | threads | way | company sizes that change the row | ms at 1 row | ms at 16 rows | ms at 512 rows |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(args.n, args.k, generator=gen).to(dtype)
        rows = torch.randn(512, args.k, generator=gen).to(dtype)
        for threads in args.threads:
            torch.set_num_threads(threads)
            ways = {"plain": lambda x: F.linear(x, weight)}
            ways.update({f"blocks of {b}": (lambda x, b=b: blocked(x, weight, b)) for b in args.block})
            for name, linear in ways.items():
                ms = [timed_ms(lambda m=m: linear(rows[:m]), args.repeats) for m in (1, 16, 512)]
                print(f"| {str(dtype).removeprefix('torch.')} | {threads} | {name} | {varies(linear, rows)} of {len(COMPANY)} | "
                      + " | ".join(f"{t:.2f}" for t in ms) + " |")


if __name__ == "__main__":
    main()
