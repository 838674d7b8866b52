"""Disk is a budget too: what a run's checkpoints take in the run directory of every node
(`disk_estimate`, kept in the plan) and whether that fits each node's free space with the node's
logs beside it (`disk_budget`; a job's node log is rotated, so it takes at most `log_bytes`).

How many checkpoints are on disk at once. transformers' Trainer (5.6, `_save_checkpoint` and
`trainer_utils.rotate_checkpoints`) rotates only after a new checkpoint is complete (its
trainer_state.json written), on every process that writes checkpoints (each node's local rank 0
with save_on_each_node), and it always keeps the most recent checkpoint (newest mtime, or the
highest step where mtimes are not reliable) and the best one (load_best_model_at_end). So the
checkpoint a resume continues from (checkpoints.resume_point: the latest complete one every node
has) is never deleted, as long as save_total_limit is at least 2 on a cluster of several nodes:
with 1, a node that finished a save has already deleted the previous checkpoint while another
node, stopped during the same save, has only that previous one. While a new checkpoint is being
written the older ones are all still there: save_total_limit + 1 checkpoints at the peak, then
the final model beside the kept ones.

One checkpoint's size is an estimate, per node, in bytes per parameter (P: the model's, A: the
LoRA adapter's), of what LLaMA-Factory 0.9.5 and transformers write:

- full, plain DDP or FSDP (full state dicts): the weights as trained (fp32: LLaMA-Factory upcasts
  trainable weights unless pure_bf16) and the optimizer's two moments: 8 for AdamW's fp32 ones,
  2 for an 8-bit AdamW's (bitsandbytes' `adamw_8bit`, `paged_adamw_8bit`, torchao's
  `adamw_torch_8bit`: a byte each, and one fp32 scale per block of 256: 2.03), 1 for a 4-bit
  one's; so 4 + 8 = 12 x P with AdamW, 4 + 2.03 = 6.03 x P with 8-bit AdamW, plus the input
  embedding's moments in fp32 (transformers keeps an nn.Embedding's optimizer state 32-bit under
  bitsandbytes: 5.97 more bytes for each of its vocabulary x hidden parameters);
- full, DeepSpeed, every ZeRO stage with or without offload and hpZ (bf16): the bf16 weights
  (model.safetensors, 2), for ZeRO-0/1/2 DeepSpeed's own copy of them (mp_rank_00_model_states.pt,
  2), and this node's share of the per-rank optimizer shards: fp32 master weights and two moments,
  12 x P x processes on the node / world size (the whole 12 where the runs directory is shared
  storage: every rank writes there); offloading changes where they live while training, not what
  is saved;
- LoRA, and QLoRA alike (its adapter is trained and saved as LoRA's; the 4-bit base is never
  saved): the adapter in fp32 and its optimizer's moments, 4 + 8 = 12 x A (+ 4 x A of fp32
  master weights under DeepSpeed), A counted from the model's shape (upper bound: key/value
  projections counted as wide as the hidden size);
- freeze: the whole model's weights, 2 x P (its trainable layers' optimizer state not counted);
- save_only_model: the weights alone.

The final model (written once at the end) is the weights alone. Tokenizer files, RNG and scheduler
states (a few MB) are not counted. tests/data/checkpoint_sizes.json holds checkpoints measured on
the lab and on the GPU machine, each replayed against this model by
tests/unit/planner/test_checkpoint_sizes.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from .memory import GIB
from .plan import Stage

# The bytes a parameter's optimizer moments take, by transformers' `optim` (AdamW's fp32 two
# when it is not named here): 8-bit states a byte each plus an fp32 scale per 256, 4-bit half.
MOMENTS = {
    "adamw_8bit": 2 + 8 / 256,
    "adamw_bnb_8bit": 2 + 8 / 256,
    "paged_adamw_8bit": 2 + 8 / 256,
    "adamw_torch_8bit": 2 + 8 / 256,
    "adamw_torch_4bit": 1 + 8 / 256,
}
# The linear layers of a Qwen2/Llama-style decoder layer, (inputs, outputs): h the hidden size, i
# the MLP's intermediate size. LoRA adds rank x (inputs + outputs) parameters to each. k_proj and
# v_proj are counted as wide as h (grouped-query attention makes them narrower): an upper bound.
_LORA_LAYERS = {
    "q_proj": ("h", "h"),
    "k_proj": ("h", "h"),
    "v_proj": ("h", "h"),
    "o_proj": ("h", "h"),
    "gate_proj": ("h", "i"),
    "up_proj": ("h", "i"),
    "down_proj": ("i", "h"),
}


def lora_params(shape: Mapping[str, Any] | None, rank: int, target: Any) -> int | None:  # noqa: ANN401
    """Parameters of the LoRA adapter (an upper bound), or None when the shape is unknown.

    target: LLaMA-Factory's lora_target ("all", or module names, comma-separated or a list); a
    name this table does not know counts as every linear layer.
    """
    if not shape:
        return None
    names = target if isinstance(target, list) else str(target or "all").split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    if not names or any(n not in _LORA_LAYERS for n in names):
        names = list(_LORA_LAYERS)
    hidden = int(shape["hidden"])
    size = {"h": hidden, "i": int(shape.get("intermediate") or 4 * hidden)}
    per_layer = sum(size[a] + size[b] for a, b in (_LORA_LAYERS[n] for n in dict.fromkeys(names)))
    return int(rank) * per_layer * int(shape["layers"])


def _moments(args: Mapping[str, Any]) -> tuple[str, float]:
    """The optimizer's moments: what they are and their bytes a parameter."""
    optim = str(args.get("optim") or "adamw_torch")
    if optim in MOMENTS:
        bits = "4-bit" if "4bit" in optim else "8-bit"
        return f"{optim}'s 2 {bits} moments", MOMENTS[optim]
    return "AdamW's 2 fp32 moments", 8.0


def _terms(
    finetuning: str, stage: Stage, args: Mapping[str, Any], share: float
) -> tuple[list[tuple[str, float]], float]:
    """What one checkpoint holds per parameter (what, bytes), and the final model's bytes."""
    half = bool(args.get("bf16") or args.get("fp16"))
    deepspeed = stage.zero is not None
    if finetuning == "freeze":
        return [("the bf16 weights", 2.0)], 2.0
    if finetuning == "lora":
        weights = 2.0 if args.get("pure_bf16") else 4.0
        terms = [(f"the adapter ({'bf16' if weights == 2 else 'fp32'})", weights)]
        if not args.get("save_only_model"):
            terms.append(_moments(args))
            if deepspeed:
                terms.append(("DeepSpeed's fp32 master weights", 4.0))
        return terms, weights
    if deepspeed:
        weights = 2.0 if half or args.get("pure_bf16") else 4.0
    else:
        weights = 2.0 if args.get("pure_bf16") else 4.0
    dtype = "bf16" if weights == 2 else "fp32"
    terms = [(f"the {dtype} weights", weights)]
    if args.get("save_only_model"):
        return terms, weights
    if not deepspeed:
        return [*terms, _moments(args)], weights
    if stage.zero < 3:
        terms.append(("DeepSpeed's copy of the weights", weights))
    shards = (
        "every rank's" if share == 1 else f"this node's {Fraction(share).limit_denominator()} of"
    )
    terms.append(
        (f"{shards} optimizer shards (fp32 master weights, 2 AdamW moments: 12)", 12.0 * share)
    )
    return terms, weights


def _embedding_terms(
    finetuning: str,
    stage: Stage,
    args: Mapping[str, Any],
    shape: Mapping[str, Any] | None,
    unit: int | None,
) -> list[tuple[str, float]]:
    """The input embedding's moments kept in fp32 under an 8-bit optimizer (bitsandbytes'
    module override, set by transformers' Trainer), per parameter of the model; none where the
    shape is unknown."""
    optim = str(args.get("optim") or "")
    if finetuning != "full" or stage.zero is not None or optim not in MOMENTS or not unit:
        return []
    if not shape or args.get("save_only_model"):
        return []
    embedding = int(shape["vocab"]) * int(shape["hidden"])
    return [("the embedding's moments kept fp32", (8.0 - MOMENTS[optim]) * embedding / unit)]


def saves_of(args: Mapping[str, Any], steps: int | None) -> int | None:
    """How many checkpoints the run writes (None: not known)."""
    strategy = str(args.get("save_strategy") or "steps")
    if strategy == "no":
        return 0
    if strategy == "epoch":
        return math.ceil(float(args.get("num_train_epochs") or 1))
    if strategy == "steps" and steps is not None:
        return math.ceil(steps / int(args.get("save_steps") or 500))
    return None


def disk_estimate(
    *,
    model: Mapping[str, Any],
    stage: Stage | str,
    args: Mapping[str, Any],
    nproc: int,
    world: int,
    shared_storage: bool = False,
    steps: int | None = None,
    limit_source: str = "",
) -> dict[str, Any]:
    """One checkpoint's size on each node, how many are on disk at once, the final model's size,
    and the bytes a node's run directory needs (None where unknown); `formula` says how.

    args: the run's training arguments; steps: its optimizer steps (None: unknown), which bound
    the checkpoints a short run writes; limit_source: where save_total_limit came from.
    """
    finetuning = str(model["finetuning_type"])
    share = 1.0 if shared_storage else nproc / world
    terms, final_per = _terms(finetuning, Stage(stage), args, share)
    if finetuning == "lora":
        unit = lora_params(
            model.get("shape"), int(args.get("lora_rank") or 8), model["lora_target"]
        )
        what = "adapter parameters"
    else:
        unit = int(float(model["params_b"]) * 1e9)
        what = "parameters"
    terms += _embedding_terms(finetuning, Stage(stage), args, model.get("shape"), unit)
    per = sum(value for _, value in terms)
    formula = " + ".join(f"{name} {value:g}" for name, value in terms)
    if unit:
        formula += f" = {per:g} bytes x {_count(unit)} {what}"
    limit = args.get("save_total_limit")
    limit = int(limit) if limit else None
    if limit and args.get("load_best_model_at_end"):
        limit = max(limit, 2)  # the best and the latest are both kept
    saves = saves_of(args, steps)
    peak = limit + 1 if limit else None
    count = min(x for x in (peak, saves) if x is not None) if (peak or saves is not None) else None
    checkpoint = round(per * unit) if unit else None
    final = round(final_per * unit) if unit else None
    needed = count * checkpoint + final if checkpoint is not None and count is not None else None
    return {
        "save_total_limit": limit,
        "limit_source": limit_source,
        "save_steps": int(args.get("save_steps") or 500),
        "saves": saves,
        "count": count,
        "checkpoint_bytes": checkpoint,
        "final_bytes": final,
        "needed_bytes": needed,
        "formula": formula,
        "several_nodes": world > nproc,
    }


def _count(value: int) -> str:
    """7.62B, 21.6M: a parameter count as people write it."""
    return f"{value / 1e9:.3g}B" if value >= 1e9 else f"{value / 1e6:.3g}M"


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB"


def disk_summary(disk: Mapping[str, Any]) -> list[str]:
    """The plan's lines on checkpoints and the disk they need on every node."""
    limit = disk["save_total_limit"]
    if limit:
        kept = f"the latest {limit} kept (save_total_limit, {disk['limit_source']})"
    else:
        kept = f"every one kept (no save_total_limit, {disk['limit_source']})"
    lines = [f"Checkpoints every {disk['save_steps']} steps: {kept}"]
    if limit == 1 and disk["several_nodes"]:
        lines[0] += (
            "; with 1, a failure during a save can leave no checkpoint that every node has "
            "(2 or more is safe to resume)"
        )
    if disk["checkpoint_bytes"] is None:
        lines.append(
            "Disk per node: not estimated (the model's shape is unknown, so its adapter cannot be "
            "counted); not checked"
        )
    elif disk["needed_bytes"] is None:
        lines.append(
            f"Disk per node: about {_gib(disk['checkpoint_bytes'])} a checkpoint (estimated: "
            f"{disk['formula']}); how many the run writes is unknown, so not checked"
        )
    else:
        lines.append(
            f"Disk per node: up to {_needed(disk)}; a checkpoint estimated as {disk['formula']}; "
            "checked, with the node's logs (rotated: cluster.yml's node_log_max_mib), against "
            "every node's free space before anything is written"
        )
    return lines


def _needed(disk: Mapping[str, Any], logs: int = 0) -> str:
    """369.0 GiB (4 checkpoints x 85.2 GiB: save_total_limit 3 + the one being written; and the
    final model 28.4 GiB; and the node's logs, at most 0.2 GiB)."""
    count = disk["count"]
    parts = f"{count} checkpoint{'s' if count != 1 else ''} x {_gib(disk['checkpoint_bytes'])}"
    if disk["save_total_limit"] and count == disk["save_total_limit"] + 1:
        parts += f": save_total_limit {disk['save_total_limit']} + the one being written"
    parts += f"; and the final model {_gib(disk['final_bytes'])}"
    if logs:
        parts += f"; and the node's logs, rotated, at most {_gib(logs)}"
    return f"{_gib(disk['needed_bytes'] + logs)} ({parts})"


def _largest_limit(disk: Mapping[str, Any], free: float) -> int:
    """The largest save_total_limit whose checkpoints fit `free` bytes (0: not even one)."""
    return max(0, int((free - disk["final_bytes"]) // disk["checkpoint_bytes"]) - 1)


def log_bytes(max_mib: object, kept: object) -> int:
    """The most a job's node log takes on a node's disk, rotated past `max_mib` with `kept`
    rotated files (llama-job's logs.rotate_log): the live log and the kept ones."""
    return int(float(str(max_mib))) * (1 << 20) * (int(str(kept)) + 1)


def disk_budget(
    plan: Mapping[str, Any],
    free: Mapping[str, Any],
    runs_dir: str = "the runs directory",
    logs: int = 0,
) -> dict[str, Any]:
    """Whether the run's checkpoints and the node's logs fit every node's free space, and the
    message that says so.

    free maps a node to its free bytes where the run directory will be (a number, or a mapping
    with `free` and `path`, the nearest existing directory measured), or None where unknown: such
    a node is named and not refused. logs: the bytes a node's logs take at most (log_bytes).
    Returns ok, message and short (the nodes that lack space).
    """
    disk = plan.get("disk") or {}
    needed = disk.get("needed_bytes")
    if needed is not None:
        needed += logs
    if plan.get("resume"):
        return {"ok": True, "short": [], "message": "A resumed run: its disk was checked at start."}
    refusals, notes, short = [], [], []
    for host, value in free.items():
        path, measured = runs_dir, value
        if isinstance(value, Mapping):
            measured = value.get("free")
            if value.get("path") and value["path"] != runs_dir:
                path = f"{runs_dir} (measured at {value['path']}, its nearest existing directory)"
        if isinstance(measured, bool) or not isinstance(measured, (int, float)):
            notes.append(
                f"{host}: the free space of {path} is unknown, so the checkpoints"
                + (f" ({_gib(needed)})" if needed is not None else "")
                + " were not checked against it"
            )
        elif needed is None:
            notes.append(
                f"{host}: {_gib(measured)} free on {path}; the checkpoints' size is not known, "
                "so it was not checked"
            )
        elif measured < needed:
            refusals.append(_refusal(host, path, float(measured), disk, logs))
            short.append(host)
        else:
            notes.append(f"{host}: {_gib(needed)} needed, {_gib(measured)} free on {path}")
    message = " ".join(refusals) if refusals else "Disk: " + "; ".join(notes) + "."
    return {"ok": not refusals, "short": short, "message": message}


def _refusal(host: str, path: str, free: float, disk: Mapping[str, Any], logs: int) -> str:
    """Why a node's disk cannot hold the run, with the ways out."""
    fits = _largest_limit(disk, free - logs)
    fewer = (
        f'keep fewer checkpoints (-e \'{{"train_args": {{"save_total_limit": {fits}}}}}\' fits)'
        if fits >= 1 and fits < (disk["save_total_limit"] or math.inf)
        else "not even one checkpoint and the final model fit, so a smaller save_total_limit "
        "does not help"
    )
    return (
        f"{host}: the run's checkpoints would not fit the free space of {path}: "
        f"{_gib(free)} free, {_needed(disk, logs)} needed. Ways out: {fewer}; free space there, or "
        f"put cluster_runs_dir on a larger disk; or fine-tune with LoRA (-e finetuning_type=lora), "
        f"whose checkpoints hold only the adapter. One checkpoint, estimated: {disk['formula']}. "
        "Nothing was written to the nodes."
    )
