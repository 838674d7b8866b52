#!/usr/bin/env python3
"""Steady-state tokens/s, MFU and final loss of LLaMA-Factory runs, from their trainer_log.jsonl.

LLaMA-Factory logs, per logging step, the real (non-padding) input tokens seen by all ranks
(`total_tokens`, with include_num_input_tokens_seen: non_padding) and `throughput` = total_tokens
over the seconds since training began. So the seconds at a record are total_tokens / throughput,
and the rate between two records after the warm-up is their token difference over their time
difference: start-up and warm-up are left out.

    tokens.py --params 494e6 --gpus 2 --warmup 20 NAME=path/to/trainer_log.jsonl ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEAK_BF16 = 989e12  # dense bf16 FLOP/s of one H100/H200 SXM (datasheet)


def summarise(path: Path, warmup: int, params: float, gpus: int) -> dict[str, float]:
    """tokens/s after the warm-up step, MFU and the last logged loss of one run."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # Logging steps only: the records written after training (save, summary) repeat the last
    # token count at a later time.
    timed = [r for r in records if r.get("throughput") and r.get("total_tokens") and "loss" in r]
    after = [r for r in timed if r["current_steps"] >= warmup] or timed
    first, last = after[0], after[-1]

    def clock(record: dict) -> float:
        return record["total_tokens"] / record["throughput"]

    seconds = clock(last) - clock(first)
    rate = (last["total_tokens"] - first["total_tokens"]) / seconds if seconds > 0 else 0.0
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    return {
        "steps": last["current_steps"],
        "tokens_per_s": round(rate, 1),
        "mfu": round(6 * params * rate / (PEAK_BF16 * gpus), 4),
        "final_loss": losses[-1] if losses else float("nan"),
    }


def main() -> None:
    """Print one JSON line per run and the ratios asked for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True, help="model parameters")
    parser.add_argument("--warmup", type=int, default=20, help="first step of the timed window")
    parser.add_argument("runs", nargs="+", help="NAME:GPUS=trainer_log.jsonl")
    args = parser.parse_args()
    results = {}
    for spec in args.runs:
        label, path = spec.split("=", 1)
        name, gpus = label.split(":")
        if Path(path).exists():
            results[name] = summarise(Path(path), args.warmup, args.params, int(gpus))
            print(json.dumps({"run": name, "gpus": int(gpus), **results[name]}))
    rate = {name: r["tokens_per_s"] for name, r in results.items()}
    if rate.get("train_yml") and rate.get("hand"):
        print(json.dumps({"ratio_train_yml_over_hand": round(rate["train_yml"] / rate["hand"], 3)}))
    if rate.get("hand") and rate.get("one_gpu"):
        print(json.dumps({"scaling_2gpu": round(rate["hand"] / (2 * rate["one_gpu"]), 3)}))


if __name__ == "__main__":
    main()
