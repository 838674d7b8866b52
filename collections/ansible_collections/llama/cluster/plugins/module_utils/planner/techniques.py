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

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import PlanError
from .plan import Request, Stage

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

    @property
    def plain(self) -> bool:
        return self == PLAIN

    def label(self) -> str:
        """'8-bit AdamW + Liger', '' for the plain run."""
        parts = []
        if self.quant:
            parts.append(f"QLoRA {self.quant}-bit")
        if self.optim == "adamw_8bit":
            parts.append("8-bit AdamW")
        if self.liger:
            parts.append("Liger")
        return " + ".join(parts)

    def train_args(self) -> dict[str, object]:
        """What train.yaml sets for it."""
        args: dict[str, object] = {}
        if self.optim != PLAIN.optim:
            args["optim"] = self.optim
        if self.liger:
            args["enable_liger_kernel"] = True
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
) -> Iterator[Technique]:
    """The techniques the search tries with this fine-tuning type and stage.

    `quantization`: the QLoRA bits the user asked for (then only QLoRA); `available`: the
    optional packages every node has; `fallback`: QLoRA alone, for a LoRA run whose bf16 weights
    fit the GPU with no stage (never under numerics exact)."""
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
    request: Request,
    model: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    accelerator: str,
    available: frozenset[str],
) -> None:
    """QLoRA (-e quantization_bit=4) as measured: LoRA, plain DDP, NVIDIA GPUs, bitsandbytes on
    every node, numerics not exact; PlanError naming what to change otherwise."""
    bits = request.quantization_bit
    problems = []
    if model["finetuning_type"] != "lora":
        problems.append(
            f"QLoRA trains LoRA adapters on {bits}-bit frozen weights; this run is "
            f"finetuning_type={model['finetuning_type']}: add -e finetuning_type=lora"
        )
    if request.stage not in (None, Stage.NONE):
        problems.append(
            f"QLoRA was measured with plain DDP only, not deepspeed={request.stage}: "
            "leave deepspeed to the planner (-e deepspeed=auto)"
        )
    if request.numerics == "exact":
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
