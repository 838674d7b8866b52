"""The memory-saving techniques the search may choose besides DeepSpeed's stages (issue 38): an
8-bit optimizer, Liger's kernels, 4-bit QLoRA weights. Each is a candidate only where it was
measured (bench/gpu/memory_grid.py's cards grid, BENCHMARKS.md section 10), and each change of the
run's numerics is allowed only where its loss was shown to follow fp32 AdamW's and the user has
not forbidden it (`numerics: exact`).

- `adamw_8bit`: bitsandbytes' 8-bit AdamW (transformers' `optim: adamw_8bit`): 2.1 bytes of
  optimizer state a parameter instead of fp32 AdamW's 8. Measured over 300 steps of a 1.5B full
  fine-tune, same data and seed: its loss stayed within 0.0031 of fp32 AdamW's at every step
  (mean 0.0008; the same fp32 run repeated differs by up to 0.0023). torchao's
  `adamw_torch_8bit` is not a candidate: its step took twice as long and its loss departed from
  fp32 AdamW's by 0.115 over the last 50 steps.
- `liger`: Liger-Kernel's fused linear cross-entropy (and its norm, SwiGLU and RoPE kernels):
  the logits of a micro-batch are never held whole, so larger micro-batches fit. Same numerics.
- `qlora`: the frozen weights in 4-bit NF4 (bitsandbytes, double quantization), LoRA on top:
  about 0.5 bytes a weight instead of 2. A change of numerics: chosen when asked
  (`-e quantization_bit=4`), or by the planner for a LoRA run whose bf16 weights fit no stage.
- `compiled`: torch.compile (LLaMA-Factory's `torch_compile`), a twin of each technique it was
  measured with (COMPILE_SAVING: the share of a step it saved, beside the same configuration
  uncompiled in one device call); a candidate only with plain DDP, and only where the run is long
  enough to repay its one-off compilation (decisions.choose_compile). Same numerics.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .errors import PlanError

# The values of -e numerics: `measured` (default) allows the numerics changes measured to hold;
# `exact` forbids every one (8-bit optimizer states, a planner-chosen QLoRA, FP8).
NUMERICS = ("measured", "exact")
# -e quantization_bit: the QLoRA precision measured (bitsandbytes NF4).
QUANTIZATION_BITS = (4,)
# The packages of the node stack the techniques need (roles/llamafactory's stack probe reports
# each node's version of them in the llama_stack facts).
OPTIONAL = ("bitsandbytes", "liger-kernel")


@dataclass(frozen=True)
class Technique:
    """How a candidate saves memory besides its DeepSpeed stage (none: the plain run)."""

    optim: str = "adamw_torch"  # adamw_8bit: bitsandbytes' 8-bit AdamW
    liger: bool = False
    quant: int = 0  # 4: QLoRA
    compiled: bool = False  # torch.compile

    @property
    def plain(self) -> bool:
        return self == PLAIN

    @property
    def uncompiled(self) -> Technique:
        """The same technique without torch.compile."""
        return replace(self, compiled=False)

    def compile_saving(self, finetuning: str) -> float | None:
        """The share of a step torch.compile saved with this technique (COMPILE_SAVING), None
        where it was not measured."""
        kind = "full" if finetuning == "full" else "lora"
        return COMPILE_SAVING.get((kind, self.optim, self.liger, self.quant))

    def compile_failure(self, finetuning: str) -> str | None:
        """Why torch.compile failed with this technique where it was measured to (COMPILE_FAILS),
        None elsewhere."""
        kind = "full" if finetuning == "full" else "lora"
        failed = COMPILE_FAILS.get((kind, self.optim, self.liger, self.quant))
        return f"{failed} (measured)" if failed else None

    def label(self) -> str:
        """'8-bit AdamW + Liger', '' for the plain run."""
        parts = []
        if self.quant:
            parts.append(f"QLoRA {self.quant}-bit")
        if self.optim == "adamw_8bit":
            parts.append("8-bit AdamW")
        if self.liger:
            parts.append("Liger")
        if self.compiled:
            parts.append("torch.compile")
        return " + ".join(parts)

    def train_args(self) -> dict[str, object]:
        """What train.yaml sets for it."""
        args: dict[str, object] = {}
        if self.optim != PLAIN.optim:
            args["optim"] = self.optim
        if self.liger:
            args["enable_liger_kernel"] = True
        if self.compiled:
            args["torch_compile"] = True
        if self.quant:
            args.update(
                {
                    "quantization_bit": self.quant,
                    "quantization_method": "bnb",
                    "double_quantization": True,
                }
            )
        return args

    def numerics_changes(self) -> list[str]:
        """What it changes in the run's numerics (empty: nothing)."""
        changes = []
        if self.optim == "adamw_8bit":
            changes.append("8-bit AdamW states")
        if self.quant:
            changes.append(f"{self.quant}-bit frozen weights")
        return changes

    def allows(self, checkpointing: bool) -> bool:
        """Whether it is a candidate with or without gradient checkpointing: Liger was timed
        with checkpointing only (without it, the plain kernels' speed was measured instead)."""
        return checkpointing or not self.liger

    def needs(self) -> list[str]:
        """The optional packages of the node stack it trains with (llama_stack facts)."""
        return (["bitsandbytes"] if self.optim == "adamw_8bit" or self.quant else []) + (
            ["liger-kernel"] if self.liger else []
        )


PLAIN = Technique()
EIGHT_BIT = Technique(optim="adamw_8bit")
LIGER = Technique(liger=True)
QLORA = Technique(quant=4)

# What the cards grid measured, by fine-tuning type and stage (anything else is not a candidate).
MEASURED = {
    ("full", "none"): (PLAIN, LIGER, EIGHT_BIT, Technique(optim="adamw_8bit", liger=True)),
    ("lora", "none"): (PLAIN, LIGER),
}
# QLoRA, measured with plain DDP only.
QUANTIZED = {("lora", "none"): (QLORA,)}
# torch.compile's share of a step saved, by (fine-tuning kind, optimizer, Liger, QLoRA bits),
# each against the same configuration uncompiled in the same device call, with plain DDP:
# BENCHMARKS.md section 7 (1.5B full, packed, no checkpointing: 0.253 -> 0.200 s and 0.255 ->
# 0.206 s), section 3.1 (7B LoRA: 0.704 -> 0.558 s) and section 12 (one H100 under a 24 GiB
# cap: 1.5B full with 8-bit AdamW, checkpointing, 2 rows: 0.2455 -> 0.1921 s; 8B LoRA with Liger,
# 4 rows: 0.970 -> 1.078 s, slower compiled: Liger's Triton kernels are not traced, and every
# checkpointed layer breaks the graph). A technique not named here is never compiled by the
# planner.
COMPILE_SAVING: dict[tuple[str, str, bool, int], float] = {
    ("full", "adamw_torch", False, 0): 0.19,
    ("full", "adamw_8bit", False, 0): 0.22,
    ("lora", "adamw_torch", False, 0): 0.21,
    ("lora", "adamw_torch", True, 0): -0.11,
}
# Where compiling failed outright (section 12: a full fine-tune with Liger, whose fused linear
# cross-entropy over the trainable lm_head fails Dynamo's tracing, TorchRuntimeError in addmm).
COMPILE_FAILS = {
    ("full", optim, True, 0): "Liger's fused cross-entropy fails torch.compile's tracing"
    for optim in ("adamw_torch", "adamw_8bit")
}

# The figures the plan prints beside a numerics change (BENCHMARKS.md section 10).
NUMERICS_EVIDENCE = {
    "adamw_8bit": (
        "over 300 steps of a 1.5B full fine-tune (same data and seed) its loss stayed within "
        "0.0031 of fp32 AdamW's, mean 0.0008; fp32 AdamW repeated: within 0.0023"
    ),
    "qlora": "4-bit NF4 weights (bitsandbytes), LoRA trained in bf16 on top",
}


def candidates(
    finetuning: str,
    stage: str,
    *,
    numerics: str = "measured",
    quantization: int = 0,
    available: frozenset[str] | set[str] = frozenset(OPTIONAL),
    fallback: bool = False,
    compiling: bool = False,
) -> Iterator[Technique]:
    """The techniques the search tries with this fine-tuning type and stage.

    `quantization`: the QLoRA bits the user asked for (then only QLoRA); `available`: the
    optional packages every node has; `fallback`: QLoRA alone, for a LoRA run whose bf16 weights
    fit the GPU with no stage (never under numerics exact); `compiling`: each technique's
    compiled twin too, where it was measured (COMPILE_SAVING; plain DDP only), after every
    uncompiled one (the search judges Liger by whether the uncompiled plain run recomputes)."""
    uncompiled = list(
        _uncompiled(
            finetuning, stage, numerics=numerics, quantization=quantization, available=available,
            fallback=fallback,
        )
    )  # fmt: skip
    yield from uncompiled
    if compiling and stage == "none":
        twins = (replace(t, compiled=True) for t in uncompiled)
        yield from (t for t in twins if t.compile_saving(finetuning) is not None)


def _uncompiled(
    finetuning: str,
    stage: str,
    *,
    numerics: str,
    quantization: int,
    available: frozenset[str] | set[str],
    fallback: bool,
) -> Iterator[Technique]:
    """candidates' techniques before their compiled twins."""
    kind = "full" if finetuning == "full" else "lora"
    if quantization:
        yield from QUANTIZED.get((kind, stage), ())
        return
    if fallback:
        if kind == "lora" and numerics != "exact" and "bitsandbytes" in available:
            yield from QUANTIZED.get((kind, stage), ())
        return
    for technique in MEASURED.get((kind, stage), (PLAIN,)):
        if numerics == "exact" and technique.numerics_changes():
            continue
        if not set(technique.needs()) <= set(available):
            continue
        yield technique


def available_packages(nodes: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The optional packages (techniques.OPTIONAL) that every node's stack has."""
    if not nodes:
        return frozenset()
    have = [{k for k, v in (n.get("packages") or {}).items() if v} for n in nodes]
    return frozenset(set.intersection(*have))


def check_quantization(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    accelerator: str,
    available: frozenset[str],
) -> None:
    """QLoRA (-e quantization_bit=4) as measured: LoRA, plain DDP, NVIDIA GPUs, bitsandbytes on
    every node, numerics not exact; PlanError naming what to change otherwise."""
    bits = request["quantization_bit"]
    problems = []
    if model["finetuning_type"] != "lora":
        problems.append(
            f"QLoRA trains LoRA adapters on {bits}-bit frozen weights; this run is "
            f"finetuning_type={model['finetuning_type']}: add -e finetuning_type=lora"
        )
    if (request.get("deepspeed") or "auto") not in ("auto", "none"):
        problems.append(
            f"QLoRA was measured with plain DDP only, not deepspeed={request['deepspeed']}: "
            "leave deepspeed to the planner (-e deepspeed=auto)"
        )
    if request["numerics"] == "exact":
        problems.append(
            "4-bit weights change the run's numerics, and numerics=exact forbids every such "
            "change: drop quantization_bit, or set -e numerics=measured"
        )
    if accelerator == "cpu":
        problems.append("QLoRA's 4-bit kernels need NVIDIA GPUs; this cluster trains on CPUs")
    elif "bitsandbytes" not in available:
        lacking = [n["host"] for n in nodes if not (n.get("packages") or {}).get("bitsandbytes")]
        problems.append(
            f"QLoRA needs bitsandbytes, which {', '.join(lacking)} lack: run provision.yml "
            "(the node stack installs it)"
        )
    if problems:
        raise PlanError("QLoRA cannot be planned:\n- " + "\n- ".join(problems))
