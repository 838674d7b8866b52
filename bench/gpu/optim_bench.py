#!/usr/bin/env python3
"""The optimizer step alone, per parameter: fp32 AdamW (torch, fused) against the 8-bit and 4-bit
AdamW a memory-bound run can choose instead (issue 38), on the weights of a real model shape.

    python3 bench/gpu/optim_bench.py --shape 1.5b --out optim.json

For each optimizer: the seconds of one step (median of `--steps` after `--warmup`, each after a
device sync) and the bytes of optimizer state per parameter (torch.cuda.memory_allocated before
and after its first step), over fp32 weights shaped like the model's linear layers and its
embedding, with random gradients. DeepSpeed's CPU Adam (ZeRO-Offload's host step) is timed over
the same number of fp32 values in host memory. The planner's cost model reads the seconds per
parameter (planner/cost.py: `optimizer`, `optimizer_8bit`, `offload_step`); its memory model the
state bytes (planner/measured_memory.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_grid import SHAPES  # this folder is not a package: imported from the path set above


def weight_shapes(shape: str) -> list[tuple[int, ...]]:
    """The model's weight matrices (attention, MLP, embedding; norms and biases left out)."""
    c = SHAPES[shape]
    h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", h // heads)
    per_layer = [
        (heads * head_dim, h),
        (kv * head_dim, h),
        (kv * head_dim, h),
        (h, heads * head_dim),
        (i, h),
        (i, h),
        (h, i),
    ]
    matrices = per_layer * layers + [(c["vocab_size"], h)]
    if not c.get("tie_word_embeddings"):
        matrices.append((c["vocab_size"], h))
    return matrices


def optimizers() -> dict[str, Any]:
    """name -> a factory of the optimizer over a parameter list (those that import here)."""
    import torch  # noqa: PLC0415

    found: dict[str, Any] = {
        "adamw_torch": lambda ps: torch.optim.AdamW(ps, lr=1e-5, fused=True),
    }
    try:
        from torchao.optim import AdamW4bit, AdamW8bit  # noqa: PLC0415

        found["adamw_torch_8bit"] = lambda ps: AdamW8bit(ps, lr=1e-5)
        found["adamw_torch_4bit"] = lambda ps: AdamW4bit(ps, lr=1e-5)
    except ImportError as err:
        print(f"torchao: {err}", flush=True)
    try:
        import bitsandbytes as bnb  # noqa: PLC0415

        found["adamw_8bit"] = lambda ps: bnb.optim.AdamW(ps, lr=1e-5, optim_bits=8)
    except ImportError as err:
        print(f"bitsandbytes: {err}", flush=True)
    return found


def time_steps(step: Any, sync: Any, warmup: int, steps: int) -> float:  # noqa: ANN401
    """Median seconds of one call of `step`."""
    times = []
    for k in range(warmup + steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def gpu_optimizer(name: str, factory: Any, matrices: list[tuple[int, ...]], args: Any) -> dict:  # noqa: ANN401
    """One GPU optimizer: seconds per step and per parameter, state bytes per parameter."""
    import torch  # noqa: PLC0415

    torch.cuda.empty_cache()
    params = [torch.nn.Parameter(torch.randn(m, device="cuda") * 0.02) for m in matrices]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    opt = factory(params)
    before = torch.cuda.memory_allocated()
    try:
        opt.step()
        torch.cuda.synchronize()
        state = torch.cuda.memory_allocated() - before
        seconds = time_steps(opt.step, torch.cuda.synchronize, args.warmup, args.steps)
    except Exception as err:  # noqa: BLE001 - report the optimizer that fails, time the rest
        return {"optimizer": name, "params": n, "error": f"{type(err).__name__}: {err}"[:400]}
    finally:
        del opt, params
    return {
        "optimizer": name,
        "params": n,
        "step_s": round(seconds, 5),
        "s_per_param": seconds / n,
        "state_bytes_per_param": round(state / n, 3),
    }


def cpu_adam(n: int, args: Any) -> dict:  # noqa: ANN401
    """DeepSpeed's CPU Adam over n fp32 values in host memory (ZeRO-Offload's host step)."""
    import torch  # noqa: PLC0415

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

        chunk = 100_000_000
        params = []
        left = n
        while left > 0:
            size = min(chunk, left)
            p = torch.nn.Parameter(torch.zeros(size))
            p.grad = torch.full((size,), 1e-3)
            params.append(p)
            left -= size
        opt = DeepSpeedCPUAdam(params, lr=1e-5)
        seconds = time_steps(opt.step, lambda: None, 1, max(2, args.steps // 3))
    except Exception as err:  # noqa: BLE001 - the op builds on first use and can fail
        return {"optimizer": "deepspeed_cpu_adam", "params": n, "error": repr(err)[:400]}
    return {
        "optimizer": "deepspeed_cpu_adam",
        "params": n,
        "step_s": round(seconds, 5),
        "s_per_param": seconds / n,
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--what", choices=("gpu", "cpu-adam", "both"), default="gpu",
        help="the GPU optimizers, DeepSpeed's CPU Adam, or both",
    )
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    matrices = weight_shapes(args.shape)
    results: list[dict] = []
    if args.what != "cpu-adam" and torch.cuda.is_available():
        for name, factory in optimizers().items():
            results.append(gpu_optimizer(name, factory, matrices, args))
            print(json.dumps(results[-1]), flush=True)
    if args.what != "gpu":
        n = sum(a * b for a, b in matrices)
        results.append(cpu_adam(n, args))
        print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps({"shape": args.shape, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
