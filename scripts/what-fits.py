#!/usr/bin/env python3
"""The table "What fits on your card" of docs/performance.md, made by the planner itself.

    scripts/what-fits.py            print the table (markdown)
    scripts/what-fits.py --write    write it into docs/performance.md, between its markers

Each cell is what `train.yml -e model=M` plans for one GPU of that size (one node, the node
stack's bitsandbytes and liger-kernel installed, numerics measured, the default 8,192 tokens per
optimizer step, a run of 3 epochs over 50,000 records, long enough to repay torch.compile where
it was measured): the DeepSpeed stage, the memory-saving technique, micro-batch x accumulation,
checkpointing, the predicted tokens/s, and the tokens/s measured on the H200 under that card's
memory cap where a point of the same configuration ran alone (tests/data/cards_grid.json and
memory_grid.json, BENCHMARKS.md sections 5 and 10), else "planned, not measured".
tests/unit/planner/test_what_fits.py fails when docs/performance.md differs from what this prints,
so the
table cannot drift from the planner. Run it with the controller's venv.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "collections"))
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import (  # noqa: E402
    plan,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import (  # noqa: E402
    PlanError,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import (  # noqa: E402
    DEEPSPEED_STAGES,
)

DOC = ROOT / "docs" / "performance.md"
BEGIN = "<!-- what-fits: begin (scripts/what-fits.py --write; do not edit by hand) -->"
END = "<!-- what-fits: end -->"
# The cards, as nvidia-smi reports their memory (GiB).
CARDS = {
    "24 GB (RTX 4090)": 23.99,
    "48 GB (L40S, A6000)": 45.0,
    "80 GB (A100, H100)": 79.6,
    "141 GB (H200)": 140.4,
}
# Where the grid measured a card: the cap (GiB) its points ran under.
CAPS = {23.99: 24, 45.0: 48, 79.6: 80, 140.4: 141}
MODELS = {"1.5B": "qwen2.5-1.5b", "4B": "qwen3-4b", "8B": "qwen3-8b", "14B": "qwen2.5-14b"}
# The grids' shape names of the catalogue models above.
SHAPES = {"qwen2.5-1.5b": "1.5b", "qwen3-4b": "4b", "qwen3-8b": "8b", "qwen2.5-14b": "14b"}
KINDS = {
    "full": {"finetuning_type": "full"},
    "LoRA": {"finetuning_type": "lora"},
    "QLoRA": {"finetuning_type": "lora", "quantization_bit": 4},
}
STACK = {"bitsandbytes": "0.50.2", "liger-kernel": "0.8.5"}


@functools.cache
def group_vars(name: str) -> dict[str, Any]:
    """One file of group_vars/all, read once (the dry run of bench/gpu plans many requests)."""
    return yaml.safe_load((ROOT / "group_vars" / "all" / f"{name}.yml").read_text())


def settings() -> dict[str, Any]:
    """The planner's settings from group_vars/all, as the run_plan action reads them."""
    training = group_vars("training")
    models = group_vars("models")
    return {
        "catalogue": models["models_catalogue"],
        "defaults": training["training_defaults"],
        "rules": training["training_profile_rules"],
        "memory": training["training_memory"],
        "compile": training["training_compile"],
        "stages": list(DEEPSPEED_STAGES),
    }


# The records of the run each cell plans (its length decides torch.compile).
RECORDS = 50000


def request(model: str, extra: dict[str, Any]) -> dict[str, Any]:
    training = group_vars("training")
    return {
        "dataset_records": RECORDS,
        "model": model,
        "deepspeed": "auto",
        "train_args": {},
        "tokens_per_step": training["training_tokens_per_step"],
        "numerics": training["training_numerics"],
        "timestamp": "20260101-000000",
        **extra,
    }


def node(gib: float) -> dict[str, Any]:
    return {
        "host": "gpu",
        "rank": 0,
        "accelerator": "nvidia",
        "nproc": 1,
        "gpu_memory_gib": gib,
        "memory_source": "the card's memory",
        "packages": STACK,
    }


def measured(points: list[dict[str, Any]], p: dict[str, Any], model: str, cap: int) -> str:
    """The tokens/s of a point that ran alone with the plan's configuration, or ''."""
    args = p["train_args"]
    if int(args.get("gradient_accumulation_steps", 1)) != 1:
        return ""
    tech = p["technique"]
    for point in points:
        same = (
            point.get("alone")
            and point["status"] == "ok"
            and point["shape"] == SHAPES[model]
            and point["finetuning"] == p["model"]["finetuning_type"]
            and point["stage"] == p["deepspeed"]
            and point.get("optim", "adamw_torch") == tech["optim"]
            and bool(point.get("liger")) == tech["liger"]
            and int(point.get("quant") or 0) == tech["quantization_bit"]
            and bool(point.get("compile")) == p["torch_compile"]
            and not point.get("fp8")
            and point["checkpointing"] == p["gradient_checkpointing"]
            and point["micro_batch"] == args.get("per_device_train_batch_size")
            and point["cap_gib"] == cap
        )
        if same and point.get("tokens_per_s"):
            return f"measured {point['tokens_per_s']:,.0f}" + point.get("on", "")
    return ""


def cell(model: str, extra: dict[str, Any], gib: float, points: list[dict[str, Any]]) -> str:
    try:
        p = plan(request(model, extra), nodes=[node(gib)], ranks={"gpu": 0}, datasets=[],
                 settings=settings())  # fmt: skip
    except PlanError:
        return "does not fit"
    args = p["train_args"]
    what = [p["deepspeed"] if p["deepspeed"] != "none" else "no DeepSpeed"]
    if p["technique"]["label"] != "none":
        what.append(p["technique"]["label"])
    batch = f"{args['per_device_train_batch_size']} x {args['gradient_accumulation_steps']}"
    what.append(batch + (", ckpt" if p["gradient_checkpointing"] else ""))
    speed = f"{p['performance']['tokens_per_s']:,.0f} predicted"
    seen = measured(points, p, model, CAPS[gib]) or "planned, not measured"
    return f"{', '.join(what)}: {speed}; {seen}"


def table() -> str:
    points = []
    for name in ("cards_grid.json", "memory_grid.json", "compile_grid.json"):
        data = json.loads((ROOT / "tests" / "data" / name).read_text())
        on = " on an H100" if "H100" in data.get("gpu", "") else ""  # the others: one H200
        points += [{**point, "on": on} for point in data["points"]]
    lines = [
        "| model | fine-tuning | " + " | ".join(CARDS) + " |",
        "|---|---|" + "---|" * len(CARDS),
    ]
    for size, model in MODELS.items():
        for kind, extra in KINDS.items():
            cells = [cell(model, extra, gib, points) for gib in CARDS.values()]
            lines.append(f"| {size} ({model}) | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def with_table(text: str, body: str) -> str:
    """The document with the table between its markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + body + text[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write it into docs/performance.md")
    args = parser.parse_args()
    body = table()
    if args.write:
        DOC.write_text(with_table(DOC.read_text(), body))
    else:
        sys.stdout.write(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
