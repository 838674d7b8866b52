"""Peak GPU and host memory of one LLaMA-Factory training process, from measurements.

The coefficients below were fitted by bench/gpu/fit_memory.py to half of the points of
tests/data/memory_grid.json (LLaMA-Factory 0.9.5 on one H200, BENCHMARKS.md section 5) and are
checked against the other half by tests/unit/planner/test_memory_model.py. Standard library only.

What a training process holds, as measured (N parameters, T tokens of one micro-batch, L layers,
h hidden size, I MLP size, V vocabulary; bf16 autocast, fused AdamW, SDPA attention, packed rows):

- the peak is the larger of two moments of a step. At the optimizer step every gradient and the
  AdamW states exist and the activations are gone: `step/<finetuning>/<stage>` bytes per
  parameter (full fine-tuning without DeepSpeed fitted 15.96: 4 fp32 weights + 4 gradients +
  8 AdamW). During the backward the micro-batch's activations exist beside part of the
  gradients: `backward/<finetuning>/<stage>` bytes per parameter plus the activations;
- activations are linear in T, per token: `layer_hidden_<fp32|bf16>` x L h +
  `layer_intermediate` x L I + `vocab` x V (the logits in fp32 and their gradient). A full
  fine-tune without DeepSpeed keeps fp32 weights, so its residual stream is fp32; LoRA and every
  DeepSpeed engine run bf16 weights. With gradient checkpointing each layer keeps only its input
  (`checkpointed_layer_hidden_*`: 4 or 2 bytes, not fitted) and one layer is recomputed whole at
  a time. Attention heads do not appear: SDPA's memory is linear in T;
- ZeRO-3 with offload holds no per-parameter state on the GPU; it gathers the embedding and
  lm_head whole (`offload_embedding` bytes per value of those matrices) besides the activations;
- `overhead_gib`: what every process allocates besides; `margin`: one factor on every
  prediction, so that no fitted point is under-predicted by more than 1 %.

`fits` compares a prediction with a GPU's memory. The caching allocator reserves more than it
allocates, and a request can fail while reserved but unallocated blocks are free (seen: 7 GiB of
them beside a failed 4.6 GiB logits request), so the prediction is multiplied by
`allocator_headroom` (the smallest factor that predicts the fitted out-of-memory points) and the
CUDA context outside the allocator (`context_gib`) is added.

Host memory (`host_bytes`, peak RSS of one process): every process loads the bf16 weights into
host memory first (`host.load` bytes per parameter); ZeRO-3 with offload keeps the fp32 master
weights, gradients, AdamW states and pinned buffers there (`host.offload_full`,
`host.offload_lora` bytes per parameter, the frozen weights of a LoRA run included).
`host.base_gib`: the process itself (torch, transformers, the data pipeline).

The memory-saving techniques of issue 38 (planner/techniques.py; the cards grid of
tests/data/cards_grid.json, BENCHMARKS.md section 10) change three terms:

- `adamw_8bit`: bitsandbytes' 8-bit AdamW holds about 2 bytes of state a parameter instead of 8:
  each moment holds `adamw_8bit/<moment>` bytes per trainable parameter fewer (the step's saving
  is smaller: the 8-bit step's own buffers);
- Liger's fused linear cross-entropy never holds a micro-batch's logits whole: `vocab` gives way
  to `vocab_liger` per token and vocabulary entry (what the lm_head's fp32 gradient and the
  kernel's chunks hold instead);
- torch.compile (issue 46, tests/data/compile_grid.json, BENCHMARKS.md section 12): the compiled
  loss never holds the fp32 logits and their gradient separately, so `vocab` gives way to
  `vocab_compiled` (fitted on the 8B LoRA at 4 rows; held out: the 8B LoRA at 2 rows, -0.4 %,
  and the 1.5B full fine-tune with 8-bit AdamW at 2 rows, -1.5 %). Liger's term, where Liger
  runs, stays Liger's;
- QLoRA: the decoder's linear weights are 4-bit (`qlora_linear` bytes each, quantization
  constants included), the embedding and lm_head stay bf16 (`qlora_embedding`), instead of the
  LoRA run's per-parameter terms; activations as LoRA's.

ZeRO-2 with the optimizer offloaded (`zero2_offload`, ZeRO-Offload proper) holds the bf16 weights
and the gradient buckets on the GPU (`step/full/zero2_offload`, `backward/full/zero2_offload`);
the host holds the fp32 master weights, gradients and AdamW states and DeepSpeed's pinned buffers
(`host.offload2_full` bytes per parameter and `host.offload2_base_gib`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .techniques import PLAIN, Technique

GIB = 1024**3

# The DeepSpeed stages measured (none: plain DDP / one process); zero3_offload offloads both the
# optimizer states and the parameters (the project's ds_config.json).
STAGES = ("none", "zero2", "zero2_offload", "zero3", "zero3_offload")
FINETUNING = ("full", "lora")

# Fitted by bench/gpu/fit_memory.py on the fit half of tests/data/memory_grid.json (the module
# docstring says what each is). Bytes per parameter: step/*, backward/*, host.load,
# host.offload_*; bytes per token and L h, L I or V: layer_*, checkpointed_*, vocab; bytes per
# embedding value: offload_embedding; GiB: *_gib. Not fitted: checkpointed_layer_hidden_* (the
# saved input's dtype) and step/lora/* (the frozen bf16 weights: no fitted point peaks there).
COEFFICIENTS: dict[str, float] = {
    # Issue 38's techniques: fitted by bench/gpu/cards.py on the fit half of
    # tests/data/cards_grid.json with the coefficients below held (qlora_embedding: bf16, known).
    "adamw_8bit/backward": 4.9363,
    "adamw_8bit/step": 5.0256,
    "vocab_liger": 0.4782,
    # Issue 46 (bench/gpu/compile_grid.py on tests/data/compile_grid.json, one H100).
    "vocab_compiled": 4.23,
    "qlora_linear": 0.3694,
    "qlora_embedding": 2.0,
    "step/full/zero2_offload": 1.9696,
    "backward/full/zero2_offload": 1.9696,
    "host.offload2_full": 16.88,
    "host.offload2_base_gib": 9.87,
    # A CPU cluster (the lab) trains in fp32 in host memory: weights, gradients and AdamW's two
    # moments, 16 bytes a trained weight, 4 a frozen one (arithmetic, not measured), beside
    # host.base_gib (the process, as on a GPU node).
    "host.cpu_full": 16.0,
    "host.cpu_lora": 4.0,
    # The grid of issue 21 (bench/gpu/fit_memory.py).
    "allocator_headroom": 1.08,
    "backward/full/none": 13.2537,
    "backward/full/zero2": 13.347,
    "backward/full/zero3": 15.6723,
    "backward/lora/none": 1.90207,
    "backward/lora/zero3": 1.94142,
    "checkpointed_layer_hidden_bf16": 2.0,
    "checkpointed_layer_hidden_fp32": 4.0,
    "context_gib": 1.67,
    "host.base_gib": 1.18469,
    "host.load": 1.98324,
    "host.offload_full": 26.6435,
    "host.offload_lora": 4.70157,
    "layer_hidden_bf16": 29.2462,
    "layer_hidden_fp32": 40.7118,
    "layer_intermediate": 7.46632,
    "margin": 1.01632,
    "offload_embedding": 5.30528,
    "overhead_gib": 0.744548,
    "step/full/none": 15.9589,
    "step/full/zero2": 21.7649,
    "step/full/zero3": 17.7207,
    "step/lora/none": 2.0,
    "step/lora/zero3": 2.0,
    "vocab": 10.9936,
}


@dataclass(frozen=True)
class Shape:
    """What memory depends on in a decoder-only model."""

    params: float  # all parameters, the embedding (and an untied lm_head) included
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    tied: bool  # the lm_head is the input embedding (one vocab x hidden matrix, not two)

    @classmethod
    def from_config(cls, config: Mapping[str, object], params: float) -> Shape:
        """The shape from a config.json (Qwen2/Llama field names) and its parameter count."""
        return cls(
            params=float(params),
            hidden=int(config["hidden_size"]),  # type: ignore[arg-type]
            layers=int(config["num_hidden_layers"]),  # type: ignore[arg-type]
            intermediate=int(config["intermediate_size"]),  # type: ignore[arg-type]
            vocab=int(config["vocab_size"]),  # type: ignore[arg-type]
            tied=bool(config.get("tie_word_embeddings", False)),
        )


def _check(finetuning: str, stage: str) -> None:
    if finetuning not in FINETUNING or stage not in STAGES:
        raise ValueError(f"no measurements for {finetuning} fine-tuning with stage {stage}")
    if stage == "zero2_offload" and finetuning != "full":
        raise ValueError(f"no measurements for {finetuning} fine-tuning with stage {stage}")


def embedding_params(shape: Shape) -> float:
    """Values of the input embedding and the lm_head (one matrix when tied)."""
    return float(shape.vocab * shape.hidden * (1 if shape.tied else 2))


def features(
    shape: Shape,
    finetuning: str,
    stage: str,
    checkpointing: bool,
    tokens: int,
    *,
    technique: Technique = PLAIN,
) -> tuple[dict[str, float], dict[str, float]]:
    """The linear terms of the two moments of a step: (optimizer step, backward).

    Each maps a coefficient's name to what it multiplies, so a prediction is the larger of the
    two dot products with COEFFICIENTS; bench/gpu/fit_memory.py fits the same terms.
    """
    _check(finetuning, stage)
    n, t = shape.params, float(tokens)
    group = f"{finetuning}/{stage}"
    # Without DeepSpeed a full fine-tune keeps fp32 weights, so the residual stream and what the
    # layers save of it are fp32; LoRA's frozen weights and every DeepSpeed engine are bf16.
    width = "fp32" if finetuning == "full" and stage == "none" else "bf16"
    # Without checkpointing every layer keeps its activations; with it each layer keeps only its
    # input (4 or 2 bytes a value: not fitted) and one layer at a time is recomputed whole.
    layers = 1 if checkpointing else shape.layers
    act = {
        f"layer_hidden_{width}": t * layers * shape.hidden,
        "layer_intermediate": t * layers * shape.intermediate,
    }
    if checkpointing:
        act[f"checkpointed_layer_hidden_{width}"] = t * shape.layers * shape.hidden
    # The logits are never checkpointed; Liger's fused cross-entropy never holds them whole, and
    # a compiled loss holds less of them.
    vocab = "vocab"
    if technique.liger:
        vocab = "vocab_liger"
    elif technique.compiled:
        vocab = "vocab_compiled"
    act[vocab] = t * shape.vocab
    weights = {f"{{moment}}/{group}": n}
    if technique.quant:  # QLoRA: 4-bit linear weights, bf16 embedding and lm_head
        embedding = embedding_params(shape)
        weights = {"qlora_linear": n - embedding, "qlora_embedding": embedding}
    if technique.optim == "adamw_8bit":  # 8-bit AdamW states: fewer bytes at both moments
        weights["adamw_8bit/{moment}"] = -n if finetuning == "full" else 0.0

    def held(moment: str) -> dict[str, float]:
        return {key.format(moment=moment): value for key, value in weights.items()}

    step = {**held("step"), "overhead_gib": float(GIB)}
    if stage == "zero3_offload":
        # The weights live in host memory; the GPU gathers a few layers at a time, and the
        # embedding and lm_head matrices (the largest single tensors) whole, with their gradients.
        backward = {"offload_embedding": embedding_params(shape), "overhead_gib": float(GIB), **act}
        return step, backward
    backward = {**held("backward"), "overhead_gib": float(GIB), **act}
    return step, backward


def dot(terms: Mapping[str, float], coefficients: Mapping[str, float]) -> float:
    """Sum of each term times its coefficient (0 for a name without one)."""
    return sum(coefficients.get(name, 0.0) * value for name, value in terms.items())


def gpu_bytes(
    shape: Shape,
    finetuning: str,
    stage: str,
    checkpointing: bool,
    tokens: int,
    *,
    technique: Technique = PLAIN,
    coefficients: Mapping[str, float] = COEFFICIENTS,
) -> float:
    """Peak bytes torch allocates on the GPU of one process (max_memory_allocated)."""
    step, backward = features(shape, finetuning, stage, checkpointing, tokens, technique=technique)
    return max(dot(step, coefficients), dot(backward, coefficients)) * coefficients["margin"]


def fits(
    need_bytes: float, gpu_gib: float, coefficients: Mapping[str, float] = COEFFICIENTS
) -> bool:
    """Whether a process that allocates `need_bytes` at its peak trains on a GPU of `gpu_gib`."""
    reserved = need_bytes * coefficients["allocator_headroom"]
    return reserved + coefficients["context_gib"] * GIB <= gpu_gib * GIB


def host_bytes(
    shape: Shape, finetuning: str, stage: str, coefficients: Mapping[str, float] = COEFFICIENTS
) -> float:
    """Peak resident host memory of one training process (VmHWM)."""
    _check(finetuning, stage)
    per_param = coefficients["host.load"]
    base = coefficients["host.base_gib"]
    if stage == "zero3_offload":
        per_param = coefficients[f"host.offload_{finetuning}"]
    elif stage == "zero2_offload":
        per_param, base = coefficients["host.offload2_full"], coefficients["host.offload2_base_gib"]
    return base * GIB + per_param * shape.params
