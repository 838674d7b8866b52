"""Measure the bf16 matrix-product rate of each visible GPU (the measured MFU ceiling).

An 8192 x 8192 x 8192 bf16 product on random normal data (never zeros), 5 warm-ups, then 30
products timed one by one with CUDA events; the median is reported. Writes JSON to argv[1].
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch


def measure(device: int, n: int = 8192, reps: int = 30) -> dict[str, float | str]:
    """Return median and best TFLOP/s of an n^3 bf16 matmul on `device`."""
    torch.cuda.set_device(device)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        torch.mm(a, b)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    flops = 2 * n**3
    return {
        "device": torch.cuda.get_device_name(device),
        "tflops_median": flops / statistics.median(times) / 1e12,
        "tflops_best": flops / min(times) / 1e12,
    }


def main() -> None:
    """Measure every GPU and write the JSON (median over GPUs at top level)."""
    per_gpu = [measure(i) for i in range(torch.cuda.device_count())]
    result = {
        "n": 8192,
        "per_gpu": per_gpu,
        "tflops_median": statistics.median(float(g["tflops_median"]) for g in per_gpu),
        "torch": torch.__version__,
    }
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
