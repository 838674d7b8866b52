#!/usr/bin/env python3
"""All-reduce across every process of the cluster: checks the sum and measures bus bandwidth.

Started on every node by torchrun (through the job launcher); each rank fills a tensor with
rank + 1, all-reduces it (gloo on CPU, NCCL on GPU) and checks that every element equals
world_size * (world_size + 1) / 2. Rank 0 prints one JSON line and writes it to --result.
Bus bandwidth follows nccl-tests: algbw * 2 * (n - 1) / n, with algbw = bytes / seconds; both are
reported in gigabits per second (*_gbps), the unit of every link figure of the project.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    """Run the collective; exit 1 (after reporting) when the sum is wrong."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=16, help="tensor size per rank in MiB")
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--result", required=True, help="rank 0 writes its JSON line here")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # device_id binds the NCCL communicator to this rank's GPU (and silences barrier's warning).
    dist.init_process_group(backend=backend, device_id=device if use_cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()

    elements = args.mib * 1024 * 1024 // 4
    tensor = torch.empty(elements, dtype=torch.float32, device=device)
    expected = world * (world + 1) / 2

    for _ in range(args.warmup):
        tensor.fill_(rank + 1)
        dist.all_reduce(tensor)
    tensor.fill_(rank + 1)
    dist.all_reduce(tensor)
    correct = bool(torch.all(tensor == expected).item())

    if use_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iterations):
        dist.all_reduce(tensor)
    if use_cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iterations

    # Every rank's verdict, so that rank 0 reports a wrong sum anywhere.
    verdict = torch.tensor([0 if correct else 1], dtype=torch.int32, device=device)
    dist.all_reduce(verdict)
    all_correct = int(verdict.item()) == 0

    size = elements * 4
    algbw = size * 8 / seconds / 1e9
    result = {
        "check": "allreduce",
        "backend": backend,
        "world_size": world,
        "nnodes": int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("NNODES", "0")) or 0),
        "bytes": size,
        "iterations": args.iterations,
        "seconds_per_iteration": round(seconds, 6),
        "algbw_gbps": round(algbw, 3),
        "busbw_gbps": round(algbw * 2 * (world - 1) / world, 3) if world > 1 else 0.0,
        "sum_correct": all_correct,
        "expected": expected,
        "master": socket.gethostname() if rank == 0 else None,
    }
    if rank == 0:
        line = json.dumps(result, sort_keys=True)
        print(line, flush=True)
        with open(args.result, "w", encoding="utf-8") as out:
            out.write(line + "\n")
    dist.destroy_process_group()
    return 0 if all_correct else 1


if __name__ == "__main__":
    sys.exit(main())
