"""Time gloo's own collectives on one host, to choose how the native-composed all-reduce
(largebatch/comm/composed.py) makes its in-node reduce-scatter: the backend's `reduce_scatter_tensor`, or an
`all_to_all_single` of the chunks plus a local sum (the same bytes per rank).

    .venv/bin/torchrun --nproc-per-node 2 scripts/gloo_collectives.py [MB]      # default 16 MB of float32

Prints, on rank 0, the median of 5 rounds of 5 calls each, in ms per call.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from largebatch.dist import end_process


def main() -> None:
    dist.init_process_group("gloo")
    w = dist.get_world_size()
    n = int(float(sys.argv[1]) if len(sys.argv) > 1 else 16) * 2**20 // 4 // w * w
    x, out, recv, gathered = torch.randn(n), torch.empty(n // w), torch.empty(n), torch.empty(n)

    def per_call_ms(f, calls: int = 5) -> float:
        f()
        rounds = []
        for _ in range(5):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            dist.barrier()
            rounds.append((time.perf_counter() - t) / calls * 1e3)
        return statistics.median(rounds)

    def exchange_and_sum() -> None:
        dist.all_to_all_single(recv, x)
        torch.sum(recv.view(w, -1), dim=0, out=out)

    figures = {"all_reduce": per_call_ms(lambda: dist.all_reduce(x)),
               "reduce_scatter_tensor": per_call_ms(lambda: dist.reduce_scatter_tensor(out, x)),
               "all_to_all_single + sum": per_call_ms(exchange_and_sum),
               "all_gather_into_tensor": per_call_ms(lambda: dist.all_gather_into_tensor(gathered, out))}
    if dist.get_rank() == 0:
        print(f"{w} gloo processes, {n * 4 / 2**20:.0f} MB of float32, torch {torch.__version__}")
        for name, ms in figures.items():
            print(f"  {name:<24} {ms:8.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0, ran_group=True)   # no interpreter finalization while gloo threads live (docs/reliability.md)
