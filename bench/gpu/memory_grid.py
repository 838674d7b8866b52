#!/usr/bin/env python3
"""Peak GPU and host memory of LLaMA-Factory training over a grid of configurations (issue 21).

    python3 bench/gpu/memory_grid.py points                      # the grid, one line a point
    python3 bench/gpu/memory_grid.py run --out DIR [--deadline S] [--smoke]
    python3 bench/gpu/memory_grid.py collect RESULTS.jsonl... --to tests/data/memory_grid.json

`run` (on the GPU machine) makes the data, the tokenizer and random-initialised bf16 models of
each shape (config only, no hub), then trains every point of GRID that is not done yet with
LLaMA-Factory's own `run_exp` under torchrun (one process, as train.yml launches one GPU), the
settings train.yml renders for a GPU (bf16 with fp32 trainable weights, SDPA, packed rows) and the
project's ds_config.json for the stage. Each training process caps its CUDA allocator at the
point's GPU size with torch.cuda.set_per_process_memory_fraction: an emulated 24/48/80 GiB GPU
(141: the whole H200). Points run side by side when the sum of their caps fits the card, so no
point can be pushed out of memory by another; tokens/s is only a clean figure for points that ran
alone (`alone` in the record). A point's record (results.jsonl under --work, copied to --out after
every point): peak max_memory_allocated / max_memory_reserved, peak GPU memory of the process as
NVML saw it, peak host RSS (VmHWM) and pinned host memory, per-step times, and its status: ok, oom
(CUDA out of memory under the cap) or error. A point runs a few optimizer steps (the peak is reached
after the first optimizer step, once AdamW's states exist) and leaves without a final save.
`--deadline` (seconds from start): no point starts unless its estimated time fits, and a running
point is killed at the deadline. A second call on a still-warm machine skips the points done.

`collect` (here) adds what the current planner (plugins/filter/run_plan.py, its Memory model and
group_vars/all/training.yml's coefficients) predicts for each point, and writes the compact
records that tests/unit/planner/test_memory_model.py replays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 2**30
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# The card's memory that caps may share: an H200 reports 140.4 GiB; every process also holds a
# CUDA context (~0.5 GiB) outside its allocator cap, and model generation needs room of its own.
SHARED_GIB = 134.0
GENERATE_GIB = 22.0
STEPS = 8
DATA_SAMPLES = 2500

# config.json fields of each shape (the published configs; random weights, bf16).
_QWEN = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0}
SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {
        **_QWEN,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "1.5b": {
        **_QWEN,
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "3b": {
        **_QWEN,
        "hidden_size": 2048,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 11008,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "4b": {  # Qwen3-4B
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rope_theta": 1000000.0,
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "7b": {
        **_QWEN,
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "8b": {  # Llama-3.1-8B
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500000.0,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "14b": {  # Qwen2.5-14B
        **_QWEN,
        "hidden_size": 5120,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "intermediate_size": 13824,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    # CPU smoke test of this script only.
    "tiny": {
        **_QWEN,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 16512,
        "tie_word_embeddings": True,
    },
}

# ds_config.json's zero_optimization per stage: roles/run_config/vars/main.yml with the role's
# defaults (bucket 5e8, overlap_comm false), as train.yml renders them.
_ZERO3 = {
    "stage": 3,
    "overlap_comm": False,
    "contiguous_gradients": True,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "sub_group_size": 1000000000,
    "stage3_max_live_parameters": 1000000000,
    "stage3_max_reuse_distance": 1000000000,
    "stage3_gather_16bit_weights_on_model_save": True,
}
ZERO = {
    "zero2": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 500000000,
        "reduce_scatter": True,
        "reduce_bucket_size": 500000000,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
    },
    "zero3": _ZERO3,
    # ZeRO-Offload proper: ZeRO-2 with the optimizer (fp32 master weights, AdamW) on the host.
    "zero2_offload": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 500000000,
        "reduce_scatter": True,
        "reduce_bucket_size": 500000000,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "zero3_offload": {
        **_ZERO3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
    },
}


@dataclass(frozen=True)
class Point:
    """One configuration: shape, fine-tuning, stage, checkpointing, micro-batch, GPU cap, and the
    memory-saving techniques of issue 38 (an optimizer, 4-bit QLoRA weights, Liger's kernels);
    `steps` > STEPS and `seed` make a numerics run (its loss recorded at every step)."""

    shape: str
    finetuning: str  # full | lora
    stage: str  # none | zero2 | zero2_offload | zero3 | zero3_offload
    checkpointing: bool
    micro_batch: int
    cutoff: int  # tokens of one packed row
    cap_gib: int  # the emulated GPU: 24, 48, 80 or 141 (the whole H200)
    optim: str = (
        "adamw_torch"  # transformers' `optim`: adamw_torch_8bit (torchao), adamw_8bit (bnb)
    )
    quant: int = 0  # quantization_bit: 4 = QLoRA (bitsandbytes NF4)
    liger: bool = False  # enable_liger_kernel (fused linear cross-entropy among them)
    steps: int = STEPS
    seed: int = 42
    alone: bool = False  # timed: starts on an idle GPU, and nothing starts beside it
    compile: bool = False  # torch_compile (issue 46): the first steps compile
    fp8: bool = False  # fp8 (torchao) as train.yml renders it: bf16 off, ACCELERATE_MIXED_PRECISION
    save: bool = False  # one checkpoint after the last step, its files measured (issue 44)

    @property
    def name(self) -> str:
        ckpt = "ckpt" if self.checkpointing else "nockpt"
        name = (
            f"{self.shape}-{self.finetuning}-{self.stage}-{ckpt}-"
            f"{self.micro_batch}x{self.cutoff}-cap{self.cap_gib}"
        )
        extras = [
            self.optim if self.optim != "adamw_torch" else "",
            f"q{self.quant}" if self.quant else "",
            "liger" if self.liger else "",
            f"{self.steps}steps-seed{self.seed}" if self.steps != STEPS else "",
            "compile" if self.compile else "",
            "fp8" if self.fp8 else "",
            "save" if self.save else "",
            "alone" if self.alone else "",
        ]
        return "-".join([name, *[e for e in extras if e]])

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch (packed rows are full)."""
        return self.micro_batch * self.cutoff

    @property
    def offload(self) -> bool:
        """Whether DeepSpeed's CPU Adam runs the optimizer (host memory, one at a time)."""
        return self.stage.endswith("_offload")

    def seconds(self) -> float:
        """A rough duration, for the deadline: start-up, model load and the steps."""
        size = SIZES_B[self.shape]
        per_step = 0.05 * size * self.tokens / 4096 * (1.4 if self.checkpointing else 1.0)
        if self.stage == "zero3":
            per_step *= 3
        if self.offload:
            per_step += 0.6 * size if self.finetuning == "full" else 0.3 * size
        load = 4 * size * (1.2 if self.quant else 1)
        # Compilation (BENCHMARKS.md section 7: 84 s full, 126 s LoRA; FP8 about 4 minutes).
        compiling = (240 if self.fp8 else 90 if self.finetuning == "full" else 130) * self.compile
        saving = 6 * size if self.save else 0
        return 35 + load + compiling + saving + self.steps * per_step


SIZES_B = {
    "0.5b": 0.5,
    "1.5b": 1.5,
    "3b": 3,
    "4b": 4,
    "7b": 7.6,
    "8b": 8,
    "14b": 14.8,
    "tiny": 0.01,
}


def _p(spec: str) -> Point:
    """`shape ft stage ckpt|nockpt MBxCUTOFF cap [key=value ...]` -> Point."""
    shape, ft, stage, ckpt, batch, cap, *extra = spec.split()
    micro, cutoff = batch.split("x")
    options: dict[str, Any] = {}
    for item in extra:
        key, _, value = item.partition("=")
        default = getattr(Point, key)
        options[key] = (
            (value.lower() == "true") if isinstance(default, bool) else type(default)(value)
        )
    return Point(shape, ft, stage, ckpt == "ckpt", int(micro), int(cutoff), int(cap), **options)


# In priority order: what a partial run covers first. Caps are chosen so that most points fit
# (they give a measured peak) and some do not (they test the fit rule).
GRID = [
    _p(s)
    for s in (
        "0.5b full none nockpt 4x2048 48",
        "1.5b full none nockpt 4x2048 80",
        "7b lora none nockpt 4x2048 141",
        "0.5b full none ckpt 4x2048 24",
        "1.5b full none ckpt 2x2048 48",
        "3b full none nockpt 2x1024 80",
        "7b lora none ckpt 2x2048 24",
        "8b lora none nockpt 1x2048 48",
        "0.5b full zero2 nockpt 4x2048 48",
        "1.5b full zero3 ckpt 2x2048 48",
        "7b full none ckpt 1x2048 141",
        "3b full none ckpt 4x2048 80",
        "1.5b full none nockpt 2x1024 48",
        "0.5b full none nockpt 1x1024 24",
        "1.5b full none ckpt 1x1024 24",
        "7b lora none ckpt 4x2048 24",
        "8b lora none ckpt 4x2048 48",
        "7b lora none nockpt 1x2048 48",
        "0.5b full zero3_offload ckpt 2x2048 24",
        "1.5b full zero3_offload ckpt 2x2048 24",
        "3b full zero3_offload ckpt 1x2048 24",
        "7b lora zero3_offload ckpt 2x2048 24",
        "1.5b full zero2 ckpt 2x2048 48",
        "3b full zero2 ckpt 1x2048 80",
        "0.5b full zero3 nockpt 2x1024 24",
        "3b full zero3 ckpt 2x1024 80",
        "7b lora zero3 ckpt 2x2048 48",
        "8b lora none ckpt 1x2048 24",
        "0.5b lora none nockpt 4x2048 24",
        "1.5b lora none ckpt 2x1024 24",
        "3b lora none nockpt 2x2048 48",
        "3b full none nockpt 4x2048 141",
        "7b full none ckpt 2x2048 141",
        "3b full none ckpt 1x1024 48",
        "8b lora none nockpt 4x2048 141",
        "0.5b full none ckpt 8x2048 48",
        "3b full zero3_offload nockpt 2x1024 48",
        "7b full none nockpt 1x1024 141",
        "1.5b full none nockpt 8x1024 80",
        "7b lora none ckpt 8x2048 80",
        # Third call: more points for the held-out check.
        "1.5b full none ckpt 8x2048 48",
        "0.5b full zero2 ckpt 8x1024 24",
        "1.5b lora none nockpt 4x2048 48",
        "0.5b lora none ckpt 8x2048 24",
        "1.5b full zero2 nockpt 2x2048 48",
        "0.5b full zero3 ckpt 4x2048 24",
        "1.5b full zero3_offload nockpt 4x1024 24",
        "3b full none nockpt 1x2048 80",
        "3b full zero3 nockpt 1x2048 80",
        "3b lora none ckpt 4x2048 24",
        "7b lora none nockpt 2x1024 48",
        "8b lora zero3 ckpt 1x2048 24",
        "8b lora none ckpt 8x2048 80",
        "7b full none ckpt 4x1024 141",
        "8b lora zero3_offload ckpt 2x2048 24",
    )
]
SMOKE = [
    _p("tiny full none nockpt 2x256 24"),
    _p("tiny lora none ckpt 2x256 24"),
    _p("tiny full none ckpt 1x512 24"),
]

# Issue 38: the cards users own (24-48 GiB). In priority order: the numerics runs first (300
# steps of a 1.5B full fine-tune, one packed row of 2048 tokens a step, side by side: fp32 AdamW,
# each 8-bit AdamW with the same data and seed, and fp32 AdamW with another seed for the
# run-to-run noise), then the memory points of each technique (several side by side, each under
# its cap), then timed points alone on the GPU.
NUMERICS = "1.5b full none ckpt 1x2048 28 steps=300"
CARDS = [
    _p(s)
    for s in (
        f"{NUMERICS} optim=adamw_torch",
        f"{NUMERICS} optim=adamw_torch_8bit",
        f"{NUMERICS} optim=adamw_8bit",
        f"{NUMERICS} optim=adamw_torch seed=43",
        # fp32 AdamW again with the first run's seed: a second name (cap 29), the same numerics
        "1.5b full none ckpt 1x2048 29 steps=300",
        "1.5b full none ckpt 2x2048 24 optim=adamw_torch_8bit",
        "1.5b full none ckpt 4x2048 24 optim=adamw_torch_8bit",
        "1.5b full none ckpt 2x2048 24 optim=adamw_8bit",
        "4b full zero2_offload ckpt 2x2048 24",
        "8b lora none ckpt 2x2048 24 quant=4",
        "1.5b full none ckpt 4x2048 24 optim=adamw_torch_8bit liger=true",
        "4b full none ckpt 2x2048 48 optim=adamw_torch_8bit",
        "4b full none ckpt 1x2048 24 optim=adamw_torch_8bit",
        "8b lora none ckpt 4x2048 24 quant=4",
        "1.5b full zero2_offload ckpt 4x2048 24",
        "8b lora none nockpt 1x2048 24 quant=4",
        "8b lora none ckpt 4x2048 24 liger=true",
        "1.5b full none nockpt 2x2048 48 optim=adamw_torch_8bit",
        "4b full none nockpt 1x2048 80 optim=adamw_torch_8bit",
        "4b lora none ckpt 4x2048 24 quant=4",
        "8b lora none ckpt 8x2048 48 quant=4",
        # Timed, alone on the GPU (the cost model's new terms).
        "8b lora none ckpt 4x2048 24 quant=4 alone=true",
        "1.5b full none ckpt 2x2048 24 optim=adamw_torch_8bit alone=true",
        "4b full zero2_offload ckpt 2x2048 24 alone=true",
        "4b full none ckpt 2x2048 48 optim=adamw_torch_8bit alone=true",
    )
]
# The second call: the cost model's new terms from points alone on the GPU (the configurations
# the planner chooses on 24-48 GiB and their runners-up), and more memory points, held out from
# the memory fit (bench/gpu/cards.py fits on the first call's points).
CARDS2 = [
    _p(s)
    for s in (
        "1.5b full none nockpt 2x2048 48 optim=adamw_8bit",
        "4b full none nockpt 1x2048 80 optim=adamw_8bit",
        "1.5b full none ckpt 8x2048 48 optim=adamw_8bit liger=true",
        "8b lora none ckpt 8x2048 48 quant=4",
        "8b lora none nockpt 2x2048 48 liger=true",
        "4b full none ckpt 1x2048 24 optim=adamw_8bit",
        "1.5b full none ckpt 2x2048 24 optim=adamw_8bit alone=true",
        "1.5b full none ckpt 4x2048 24 optim=adamw_8bit liger=true alone=true",
        "1.5b full zero2_offload ckpt 4x2048 24 alone=true",
        "4b full none ckpt 2x2048 48 optim=adamw_8bit alone=true",
        "4b full zero2_offload ckpt 2x2048 24 alone=true",
        "8b lora none ckpt 4x2048 24 quant=4 alone=true",
        "8b lora none ckpt 4x2048 24 liger=true alone=true",
        "8b lora none ckpt 2x2048 24 quant=4 alone=true",
        "4b full none ckpt 4x2048 48 optim=adamw_8bit liger=true alone=true",
    )
]
SMOKE_CARDS = [
    _p("tiny full none ckpt 2x256 24 steps=12 optim=adamw_torch"),
    _p("tiny full none ckpt 2x256 24 steps=12 seed=43"),
    _p("tiny full none nockpt 1x256 24 alone=true"),
]
# Issue 46: torch.compile with the memory-saving techniques on a 24 GiB card, each timed alone
# beside its uncompiled twin (the ratio is the compile saving the cost model learns); first, side
# by side while the models are generated, one checkpoint each of a full fine-tune with 8-bit
# AdamW, a LoRA and a QLoRA (issue 44's checkpoint sizes); last, FP8 compiled, whose first step
# is the question.
_8BIT_LIGER = "optim=adamw_8bit liger=true"
COMPILE = [
    _p(s)
    for s in (
        "0.5b full none ckpt 1x2048 16 optim=adamw_8bit steps=2 save=true",
        "0.5b lora none ckpt 1x2048 16 steps=2 save=true",
        "0.5b lora none ckpt 1x2048 16 quant=4 steps=2 save=true",
        f"1.5b full none ckpt 4x2048 24 {_8BIT_LIGER} alone=true",
        f"1.5b full none ckpt 4x2048 24 {_8BIT_LIGER} compile=true steps=10 alone=true",
        "8b lora none ckpt 4x2048 24 liger=true alone=true",
        "8b lora none ckpt 4x2048 24 liger=true compile=true steps=10 alone=true",
        "1.5b full none ckpt 2x2048 24 optim=adamw_8bit compile=true steps=10 alone=true",
        "1.5b full none ckpt 2x2048 24 optim=adamw_8bit alone=true",
        "8b lora none ckpt 2x2048 24 compile=true steps=10 alone=true",
        "1.5b full none nockpt 4x2048 80 fp8=true compile=true steps=10 alone=true",
    )
]
SMOKE_COMPILE = [
    _p("tiny full none ckpt 1x256 24 steps=2 save=true"),
    _p("tiny lora none ckpt 1x256 24 steps=2 save=true"),
    _p("tiny full none ckpt 2x256 24 steps=4 alone=true"),
]
GRIDS = {
    "memory": (GRID, SMOKE),
    "cards": (CARDS, SMOKE_CARDS),
    "cards2": (CARDS2, SMOKE_CARDS),
    "compile": (COMPILE, SMOKE_COMPILE),
}


# --------------------------------------------------------------------------------------------
# The training process (torchrun's target): LLaMA-Factory's run_exp plus a recorder.
# --------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    """A kB field of /proc/self/status (VmHWM, VmRSS), 0 where absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# What a checkpoint's files hold, by name (the Trainer's and PEFT's file names).
CHECKPOINT_KINDS = (
    ("weights", ("model", "adapter_model", "pytorch_model")),
    ("optimizer", ("optimizer",)),
    ("scheduler", ("scheduler",)),
    ("rng", ("rng_state",)),
)


def checkpoint_sizes(folder: Path) -> dict[str, Any]:
    """Bytes on disk of one checkpoint folder by kind of file (weights, optimizer, scheduler,
    rng, other: trainer state, configs, tokenizer), and each file's size."""
    sizes: dict[str, Any] = {"folder": folder.name, "files": {}}
    for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
        if not path.is_file():
            continue
        size = path.stat().st_size
        sizes["files"][str(path.relative_to(folder))] = size
        kind = next(
            (k for k, prefixes in CHECKPOINT_KINDS if path.name.startswith(prefixes)), "other"
        )
        sizes[kind] = sizes.get(kind, 0) + size
    return sizes


def entry(config_path: Path) -> None:
    """Train one point (under torchrun) and write its record to $GRID_RESULT.

    The cap is set before anything touches CUDA, so LLaMA-Factory's model load and DeepSpeed's
    engine all allocate under it. The record is rewritten after every optimizer step, so a point
    killed for time still leaves its peaks; after the last step the process leaves at once (the
    final save is not part of the measurement).
    """
    import torch  # noqa: PLC0415
    import yaml  # noqa: PLC0415

    began = time.perf_counter()
    result = Path(os.environ["GRID_RESULT"])
    cap = float(os.environ["GRID_CAP_GIB"])
    gpu = torch.cuda.is_available()
    record: dict[str, Any] = {"pid": os.getpid(), "status": "started", "steps": []}
    if gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total), 0)
        record["gpu_total_gib"] = round(total / GIB, 2)

    def write(status: str) -> None:
        record["status"] = status
        if gpu:
            record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / GIB, 3)
            try:  # the pinned host buffers DeepSpeed's offload allocates through torch
                stats = torch.cuda.host_memory_stats()
                record["peak_pinned_gib"] = round(stats.get("allocated_bytes.all.peak", 0) / GIB, 3)
            except (AttributeError, RuntimeError):
                pass
        record["host_peak_rss_gib"] = round(_status_kib("VmHWM") / 2**20, 3)
        tmp = result.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(result)

    from transformers import TrainerCallback  # noqa: PLC0415

    class Recorder(TrainerCallback):
        """Step times (after a device sync) and peaks, written after every optimizer step."""

        def __init__(self) -> None:
            self.last = time.perf_counter()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # noqa: ANN401
            if gpu:
                torch.cuda.synchronize()
            self.last = time.perf_counter()
            record["train_begin_s"] = round(self.last - began, 1)
            record["load_peak_allocated_gib"] = (
                round(torch.cuda.max_memory_allocated() / GIB, 3) if gpu else 0.0
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:  # noqa: ANN401
            """The loss of every step (logging_steps 1); after the last one the process leaves."""
            if logs and "loss" in logs:
                record.setdefault("losses", []).append([state.global_step, float(logs["loss"])])
            if state.global_step >= state.max_steps and not saving:
                leave()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:  # noqa: ANN401
            if gpu:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if not record["steps"]:  # time to first step: start-up, load and compilation
                record["first_step_at_s"] = round(now - began, 1)
            record["steps"].append(round(now - self.last, 4))
            self.last = now
            write("ok" if state.global_step >= state.max_steps else "running")

    def leave() -> None:
        write("ok")
        sys.stdout.flush()
        os._exit(0)

    config = yaml.safe_load(config_path.read_text())
    saving = config.get("save_strategy", "no") != "no"
    from llamafactory.train.tuner import run_exp  # noqa: PLC0415

    write("loading")
    try:
        run_exp(args=config, callbacks=[Recorder()])
    except BaseException as err:
        text = f"{type(err).__name__}: {err}"
        record["error"] = text[-600:]
        write("oom" if "out of memory" in text.lower() else "error")
        raise
    if saving:  # the run's last step saved one checkpoint (status "ok" since that step)
        record["checkpoint"] = checkpoint_sizes(
            Path(config["output_dir"]) / f"checkpoint-{config['max_steps']}"
        )
    if record["status"] == "ok":  # the last step logged no loss: it ended all the same
        leave()
    record["error"] = "training ended before max_steps"
    write("error")


# --------------------------------------------------------------------------------------------
# Setup on the GPU machine: data, tokenizer, models, DeepSpeed's CPU Adam.
# --------------------------------------------------------------------------------------------


def make_model(shape: str, out: Path, tokenizer: Path) -> None:
    """A random-initialised bf16 model of `shape` (config only, no hub), with the tokenizer."""
    import torch  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    fields = {k: v for k, v in SHAPES[shape].items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(
        SHAPES[shape]["model_type"],
        **fields,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=None,
    )
    config.architectures = SHAPES[shape]["architectures"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16: half the memory and time
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tokenizer.iterdir():
        shutil.copy(f, tmp / f.name)
    n = sum(p.numel() for p in model.parameters())
    (tmp / "grid_model.json").write_text(json.dumps({"shape": shape, "params": n}))
    tmp.rename(out)


def make_data(work: Path) -> tuple[Path, Path]:
    """The synthetic alpaca set and the byte-level BPE tokenizer of bench/make_model.py."""
    sys.path.insert(0, str(HERE.parent))
    import make_model as mm  # noqa: PLC0415

    data, tok = work / "data", work / "tokenizer"
    if not (data / "dataset_info.json").exists():
        mm.write_dataset(data, DATA_SAMPLES)
    if not (tok / "tokenizer.json").exists():
        mm.build_tokenizer(tok)
    return data, tok


CPU_ADAM = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"


def train_config(point: Point, model: Path, data: Path, out: Path, gpu: bool) -> dict[str, Any]:
    """LLaMA-Factory's arguments: what train.yml renders for a GPU, with this point's choices."""
    cfg: dict[str, Any] = {
        "model_name_or_path": str(model),
        "trust_remote_code": True,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": point.finetuning,
        "dataset": "synth_alpaca",
        "dataset_dir": str(data),
        "template": "qwen",
        "cutoff_len": point.cutoff,
        "overwrite_cache": True,
        "preprocessing_num_workers": 4,
        "dataloader_num_workers": 2,
        "output_dir": str(out / "output"),
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "per_device_train_batch_size": point.micro_batch,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-4 if point.finetuning == "lora" else 1.0e-5,
        "max_steps": point.steps,
        "seed": point.seed,
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.0,
        "bf16": gpu,
        "pure_bf16": False,
        "flash_attn": "sdpa",
        "packing": True,
        "neat_packing": False,
        "disable_gradient_checkpointing": not point.checkpointing,
        "ddp_find_unused_parameters": False,
        "ddp_timeout": 1800,
    }
    if point.finetuning == "lora":
        cfg.update({"lora_rank": 8, "lora_target": "all"})
    if point.optim != "adamw_torch":
        cfg["optim"] = point.optim
    if point.quant:
        cfg.update({"quantization_bit": point.quant, "quantization_method": "bnb"})
    if point.liger:
        cfg["enable_liger_kernel"] = True
    if point.compile:
        cfg["torch_compile"] = True
    if point.fp8:  # planner/decisions.py FP8_TRAIN_ARGS (and its environment: Grid.launch)
        cfg.update({"fp8": True, "fp8_backend": "torchao", "bf16": False})
    if point.save:  # one checkpoint at the last step, as train.yml's runs save them
        cfg.update({"save_strategy": "steps", "save_steps": point.steps, "save_only_model": False})
    if point.stage != "none":
        ds = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": "auto"},
            "zero_optimization": ZERO[point.stage],
        }
        (out / "ds_config.json").write_text(json.dumps(ds, indent=2))
        cfg["deepspeed"] = str(out / "ds_config.json")
    return cfg


# --------------------------------------------------------------------------------------------
# The scheduler.
# --------------------------------------------------------------------------------------------


class Gpu:
    """Peak GPU memory of given pids as NVML reports it (absent without a GPU or pynvml)."""

    def __init__(self) -> None:
        try:
            import pynvml  # noqa: PLC0415

            pynvml.nvmlInit()
            self.nvml: Any = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self.nvml = None

    def shared_gib(self) -> float:
        """What caps may share: SHARED_GIB of an H200, less on a card with less memory (an H100
        reports 79.2 GiB), keeping the same 6.4 GiB for contexts and model generation."""
        if self.nvml is None:
            return SHARED_GIB
        total = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total / GIB
        return min(SHARED_GIB, total - 6.4)

    def used(self) -> dict[int, int]:
        """Bytes of GPU memory each process holds now."""
        if self.nvml is None:
            return {}
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except Exception:
            return {}
        return {p.pid: int(p.usedGpuMemory or 0) for p in procs}


def host_used_gib() -> float:
    """MemTotal - MemAvailable of the machine, GiB."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 2**20


@dataclass
class Running:
    """A point in flight."""

    point: Point
    proc: subprocess.Popen
    started: float
    dir: Path
    log: Any
    nvml_peak: int = 0
    alone: bool = True
    host_base: float = 0.0
    host_peak: float = 0.0


class Grid:
    """Runs the grid's points side by side within the card's memory and the deadline."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.work: Path = args.work
        self.out: Path = args.out
        self.smoke: bool = args.smoke
        grid, smoke = GRIDS[args.grid]
        self.points = smoke if args.smoke else grid
        if args.only:
            self.points = [p for p in self.points if p.name in set(args.only)]
        self.results = self.work / "results.jsonl"
        self.gpu = Gpu()
        self.shared = self.gpu.shared_gib()
        self.running: list[Running] = []
        self.port = 29600
        self.generating: dict[str, subprocess.Popen] = {}
        self.cpu_adam: subprocess.Popen | None = None
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / "grid.log").open("a")

    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def done(self) -> set[str]:
        if not self.results.exists():
            return set()
        records = [json.loads(x) for x in self.results.read_text().splitlines() if x]
        return {r["name"] for r in records if r["status"] not in ("error", "killed")}

    def model_dir(self, shape: str) -> Path:
        return self.work / "models" / shape

    def env(self) -> dict[str, str]:
        env = {**os.environ, **NO_MULTICAST, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        env.update({"HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        env["FORCE_TORCHRUN"] = "1"
        return env

    def generators(self) -> dict[str, subprocess.Popen]:
        """The model generations still running, by shape."""
        self.generating = {k: p for k, p in self.generating.items() if p.poll() is None}
        return self.generating

    def generate_gib(self) -> float:
        """GPU memory the running generations may hold."""
        return sum(2.2 * SIZES_B[shape] + 4 for shape in self.generators())

    def next_model(self, pending: list[Point]) -> None:
        """Start generating the models pending points need, in their order, side by side while
        they take at most half the card (so the points that wait for them can still start)."""
        for shape in dict.fromkeys(p.shape for p in pending):
            if self.model_dir(shape).exists() or shape in self.generators():
                continue
            need = 2.2 * SIZES_B[shape] + 4
            if self.generating and self.generate_gib() + need > self.shared / 2:
                return
            self.say(f"generating model {shape}")
            self.generating[shape] = subprocess.Popen(
                [sys.executable, __file__, "make-model", shape, str(self.model_dir(shape))],
                env=self.env(),
                stdout=(self.work / f"make_model_{shape}.log").open("w"),
                stderr=subprocess.STDOUT,
            )

    def launch(self, point: Point, data: Path) -> None:
        run_dir = self.work / "points" / point.name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cfg = train_config(point, self.model_dir(point.shape), data, run_dir, not self.smoke)
        import yaml  # noqa: PLC0415

        (run_dir / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = self.env()
        env.update(
            {
                "GRID_RESULT": str(run_dir / "result.json"),
                "GRID_CAP_GIB": str(point.cap_gib),
                "HF_DATASETS_CACHE": str(run_dir / "hf"),
            }
        )
        if point.fp8:  # what the planner sets in the ranks' environment (choose_fp8)
            env["ACCELERATE_MIXED_PRECISION"] = "fp8"
        if point.compile:  # why a compiled run takes long to its first step, if it does
            env["TORCH_LOGS"] = "recompiles,graph_breaks"
        self.port += 1
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(self.port),
            __file__,
            "entry",
            str(run_dir / "train.yaml"),
        ]
        log = (run_dir / "log").open("w")
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        alone = not self.running
        for r in self.running:
            r.alone = False
        base = host_used_gib()
        self.running.append(Running(point, proc, time.monotonic(), run_dir, log, 0, alone, base))
        self.say(f"start {point.name} (est {point.seconds():.0f} s, with {len(self.running) - 1})")

    def sample(self) -> None:
        used = self.gpu.used()
        host = host_used_gib()
        for r in self.running:
            res = r.dir / "result.json"
            pid = None
            if res.exists():
                try:
                    pid = json.loads(res.read_text()).get("pid")
                except (json.JSONDecodeError, OSError):
                    pid = None
            if pid in used:
                r.nvml_peak = max(r.nvml_peak, used[pid])
            r.host_peak = max(r.host_peak, host - r.host_base)

    def finish(self, r: Running, killed: str | None = None) -> None:
        r.log.close()
        res = r.dir / "result.json"
        record: dict[str, Any] = {}
        if res.exists():
            record = json.loads(res.read_text())
        status = killed or record.get("status", "error")
        if status in ("started", "loading", "running"):
            status = "error"
        log_text = (r.dir / "log").read_text(errors="replace")
        if status == "error" and "out of memory" in log_text.lower():
            status = "oom"
        elif status == "error" and "Signal 9 (SIGKILL)" in log_text:
            status = "killed"  # the kernel's OOM killer: host memory
        steps = record.get("steps", [])
        steady = sorted(steps[2:]) if len(steps) > 3 else sorted(steps)
        step_s = steady[len(steady) // 2] if steady else None
        out = {
            "name": r.point.name,
            **asdict(r.point),
            "tokens": r.point.tokens,
            "status": status,
            "steps_done": len(steps),
            "step_s": step_s,
            "tokens_per_s": round(r.point.tokens / step_s, 1) if step_s else None,
            "alone": r.alone,
            "wall_s": round(time.monotonic() - r.started, 1),
            "rc": r.proc.returncode,
            "nvml_peak_gib": round(r.nvml_peak / GIB, 3),
            "host_used_delta_gib": round(r.host_peak, 3),
            **{k: v for k, v in record.items() if k not in ("status", "steps", "pid")},
            "step_times": steps,
        }
        with self.results.open("a") as f:
            f.write(json.dumps(out) + "\n")
        shutil.copy(self.results, self.out / "results.jsonl")
        if status != "ok":
            tail = "\n".join(log_text.splitlines()[-25:])
            self.log.write(f"--- {r.point.name} log tail\n{tail}\n")
        shutil.rmtree(r.dir / "hf", ignore_errors=True)
        shutil.rmtree(r.dir / "output", ignore_errors=True)
        peak = out.get("peak_allocated_gib")
        self.say(
            f"end {r.point.name}: {status} in {out['wall_s']} s, peak {peak} GiB, "
            f"reserved {out.get('peak_reserved_gib')}, nvml {out['nvml_peak_gib']}, "
            f"host {out.get('host_peak_rss_gib')}, step {step_s}"
        )

    def kill(self, r: Running) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, 9)
        r.proc.wait()

    def reap(self, now: float) -> None:
        """Record the points that ended; kill those still running past the deadline."""
        for r in list(self.running):
            if r.proc.poll() is not None:
                self.running.remove(r)
                self.finish(r)
            elif now > self.deadline:
                self.kill(r)
                self.running.remove(r)
                self.finish(r, killed="timeout")

    def start_ready(self, pending: list[Point], data: Path, waited: dict[str, float]) -> None:
        """Start, in grid order, the pending points whose model, memory and time allow."""
        now = time.monotonic()
        gen = bool(self.generators())
        free = self.shared - sum(r.point.cap_gib for r in self.running)
        free -= self.generate_gib()
        adam_ready = self.cpu_adam is None or self.cpu_adam.poll() is not None
        head_blocked = False
        # One offload point at a time: each holds tens of GiB of host memory (the first call
        # ran four at once and the kernel killed one).
        offloading = any(r.point.offload for r in self.running)
        # A timed point runs on an idle GPU, and nothing starts beside it.
        if any(r.point.alone for r in self.running):
            return
        for p in list(pending):
            if not self.model_dir(p.shape).exists():
                continue
            if p.offload and (not adam_ready or offloading):
                continue
            if p.alone and (self.running or gen):
                continue
            if now + p.seconds() > self.deadline:
                continue
            need = min(p.cap_gib, self.shared)
            if need <= free and not head_blocked:
                pending.remove(p)
                self.launch(p, data)
                free -= need
                offloading = offloading or p.offload
                if p.alone:
                    return
                waited.pop(p.name, None)
            else:
                # A large point that waits too long stops smaller ones from jumping ahead.
                first = waited.setdefault(p.name, now)
                head_blocked = head_blocked or now - first > 45

    def stuck(self, pending: list[Point]) -> bool:
        """Nothing runs or is generated, and no pending point fits the time left."""
        if self.running or self.generators():
            return False
        now = time.monotonic()
        ready = [p for p in pending if self.model_dir(p.shape).exists()]
        return bool(ready) and all(now + p.seconds() > self.deadline for p in ready)

    def run(self) -> int:
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        data, _ = make_data(self.work)
        done = self.done()
        pending = [p for p in self.points if p.name not in done]
        self.say(f"{len(done)} points done before, {len(pending)} to run")
        if any(p.offload for p in pending) and not self.smoke:
            self.cpu_adam = subprocess.Popen(
                [sys.executable, "-c", CPU_ADAM],
                env=self.env(),
                stdout=(self.work / "cpu_adam.log").open("w"),
                stderr=subprocess.STDOUT,
            )
        waited: dict[str, float] = {}
        while pending or self.running:
            self.next_model(pending)
            self.sample()
            self.reap(time.monotonic())
            if time.monotonic() > self.deadline:
                break
            self.start_ready(pending, data, waited)
            if pending and self.stuck(pending):
                break
            time.sleep(0.5)
        left = [p.name for p in pending]
        self.say(f"not run (time): {len(left)} {' '.join(left)}")
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            for f in sorted(self.work.glob("*.log")):
                tar.add(f, arcname=f.name)
            for d in sorted((self.work / "points").glob("*")):
                for name in ("log", "train.yaml", "result.json"):
                    if (d / name).exists():
                        tar.add(d / name, arcname=f"{d.name}/{name}")
        return 0


# --------------------------------------------------------------------------------------------
# Here: the planner's predictions beside the measurements.
# --------------------------------------------------------------------------------------------

# Fields of a record that tests/data/memory_grid.json keeps.
KEEP = [
    "name",
    "shape",
    "finetuning",
    "stage",
    "checkpointing",
    "micro_batch",
    "cutoff",
    "cap_gib",
    "tokens",
    "status",
    "steps_done",
    "step_s",
    "tokens_per_s",
    "alone",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "nvml_peak_gib",
    "host_peak_rss_gib",
    "peak_pinned_gib",
    "host_used_delta_gib",
    "gpu_total_gib",
]


def collect(paths: list[Path], to: Path) -> None:
    """Merge results.jsonl files (the last record of a point wins) with the old predictions."""
    root = HERE.parents[1]
    sys.path.insert(0, str(root / "tests"))
    import yaml  # noqa: PLC0415
    from sources import load  # noqa: PLC0415

    rp = load("plugins/filter/run_plan.py")
    coefficients = yaml.safe_load((root / "group_vars/all/training.yml").read_text())[
        "training_memory"
    ]
    records: dict[str, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                records[rec["name"]] = rec
    order = {p.name: i for i, p in enumerate(GRID)}
    out = []
    for rec in sorted(records.values(), key=lambda r: order.get(r["name"], 999)):
        config = SHAPES[rec["shape"]]
        memory = rp.Memory(
            params=float(rp.model_params(config)),
            finetuning=rec["finetuning"],
            shape=rp.model_shape(config),
            world=1,
            coefficients=coefficients,
            budget=None,
        )
        need = memory.need(rec["stage"], rec["tokens"], rec["checkpointing"])
        kept = {k: rec.get(k) for k in KEEP}
        kept["old_predicted_gib"] = round(need / GIB, 2)
        kept["old_fits_cap"] = need <= float(coefficients["usable_fraction"]) * rec["cap_gib"] * GIB
        out.append(kept)
    payload = {
        "about": (
            "Peak memory of LLaMA-Factory 0.9.5 training on one H200 (bench/gpu/memory_grid.py, "
            "BENCHMARKS.md section 5). cap_gib is an emulated GPU: "
            "torch.cuda.set_per_process_memory_fraction in the training process (141 = the "
            "whole H200). peak_*_gib: torch.cuda.max_memory_allocated/reserved; nvml_peak_gib: "
            "the process's GPU memory as NVML saw it (500 ms samples); host_peak_rss_gib: VmHWM "
            "of the training process. old_predicted_gib: the planner's Memory.need before this "
            "grid. tokens_per_s is clean only where alone is true."
        ),
        "shapes": {
            k: {**v, "params": rp.model_params(v)} for k, v in SHAPES.items() if k != "tiny"
        },
        "points": out,
    }
    to.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(out)} points -> {to}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    pts = sub.add_parser("points")
    pts.add_argument("--grid", choices=sorted(GRIDS), default="memory")
    run = sub.add_parser("run")
    run.add_argument("--work", type=Path, default=Path("/tmp/grid"))
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--deadline", type=float, default=540.0)
    run.add_argument("--smoke", action="store_true", help="the tiny CPU points")
    run.add_argument("--grid", choices=sorted(GRIDS), default="memory", help="which grid")
    run.add_argument("--only", nargs="*", help="point names")
    ent = sub.add_parser("entry")
    ent.add_argument("config", type=Path)
    mk = sub.add_parser("make-model")
    mk.add_argument("shape")
    mk.add_argument("dest", type=Path)
    col = sub.add_parser("collect")
    col.add_argument("results", type=Path, nargs="+")
    col.add_argument("--to", type=Path, required=True)
    args = parser.parse_args()
    if args.cmd == "points":
        for p in GRIDS[args.grid][0]:
            print(f"{p.name}  est {p.seconds():.0f} s")
        return 0
    if args.cmd == "entry":
        entry(args.config)
        return 0
    if args.cmd == "make-model":
        make_model(args.shape, args.dest, args.dest.parents[1] / "tokenizer")
        return 0
    if args.cmd == "collect":
        collect(args.results, args.to)
        return 0
    return Grid(args).run()


if __name__ == "__main__":
    sys.exit(main())
