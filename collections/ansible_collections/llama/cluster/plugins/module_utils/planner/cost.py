"""Predicted time of one optimizer step of a training process: the cost model the planner ranks
its candidates with (planner/search.py). Standard library only.

A step of A micro-batches of T tokens each (N parameters, N_f the FLOP-counted ones: all but an
untied input embedding, which is a lookup; N_t the trainable ones; L layers) costs, in seconds:

- compute: A T N_f x `flops_per_token` / the plan kind's FLOP rate. A full fine-tune does 6 FLOPs
  per parameter and token (forward 2, backward 4), LoRA 4 (its frozen weights get no weight
  gradient); gradient checkpointing recomputes the forward: +2. The rates are `flop/<kind>` (seconds
  per FLOP, fitted: the kind's MFU at the H200's 989 TFLOP/s is 1 / (rate x 989e12));
- per micro-batch: A L x `layer` (launches and the work that does not grow with tokens);
- the optimizer's pass over the trainable weights, once per step: N_t x `optimizer`
  (torch's fused AdamW or DeepSpeed's, fp32; under ZeRO over each rank's 1/n partition);
- full fine-tuning without DeepSpeed: autocast's bf16 copy of the fp32 weights, every micro-batch
  (A N x `cast`);
- the DeepSpeed engine: ZeRO-1/2 move every trainable gradient into their partitioned buffers,
  every micro-batch (A N_t x `zero2`; ZeRO-1 once per step); ZeRO-3 gathers every weight for the
  forward and the backward of every micro-batch (A N x `zero3`, and A L x `zero3_layer` for its
  hooks), even on one GPU;
- offload (ZeRO-3 with the optimizer and the parameters in host memory): DeepSpeed's CPU Adam
  instead of the GPU optimizer (N_t x `offload_step`) and the weights over PCIe every
  micro-batch (A N x `offload_micro`);
- ZeRO-2 with the optimizer offloaded (ZeRO-Offload): DeepSpeed's CPU Adam over the trainable
  weights and the updated bf16 weights copied back, once per step (N_t x `offload2_step`), and
  every micro-batch's gradients copied to the host (A N x `offload2_micro`);
- the memory-saving techniques (planner/techniques.py): bitsandbytes' 8-bit AdamW instead of fp32
  AdamW (N_t x `optimizer_8bit`, measured alone: bench/gpu/optim_bench.py); Liger's kernels, whose
  fused cross-entropy computes the logits in chunks instead of whole (A T V h x `liger/<kind>`,
  fitted, and negative where the kernels are faster than what they replace); QLoRA's
  dequantization of the 4-bit linear weights for every micro-batch (A N_linear x `qlora`);
  torch.compile: the compute of the same technique uncompiled, less the share compiling saved it
  (techniques.COMPILE_SAVING, measured beside its uncompiled twin; `compiled_share`);
- communication (`communication`): the bytes each stage moves per step over the slowest link,
  ring arithmetic, plus a latency per collective and `comm_fixed` per step on more than one rank.
  The hybrid stages (ZeRO++ hpZ, FSDP's hybrid shard: several ranks per node) move part of their
  bytes between a node's own ranks only; those are not counted on the link (their cost on the
  node's bus is what ZeRO-3's `zero3` term measured on one GPU), only what crosses nodes.

The grid (tests/data/memory_grid.json) trained every point with accumulation 1, so which share of
a per-parameter term is paid per micro-batch and which per step follows DeepSpeed's mechanism
above, not a measurement. Fitted by bench/gpu/fit_cost.py on half of the grid's points; the other
half is held out (tests/unit/planner/test_cost_model.py, BENCHMARKS.md section 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .measured_memory import Shape, embedding_params
from .techniques import PLAIN, Technique

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16 (datasheet): MFU is reported against it

# Fitted by bench/gpu/fit_cost.py (seconds per unit; see the module docstring). `optimizer` is
# measured, not fitted (torch.profiler: 26 ms of fused AdamW for 1.54 B fp32 weights); `cast`
# (autocast's bf16 copies of the fp32 weights, per micro-batch) came out 0: the grid cannot tell
# it from the FLOPs. flop/full is 64 % MFU, flop/lora 38 %: the per-layer term carries the rest.
COEFFICIENTS: dict[str, float] = {
    # Issue 38 (bench/gpu/cards.py fit-cost on tests/data/cards_grid.json): offload2_step is
    # DeepSpeed's CPU Adam alone (0.37 s for 1.54 B weights on the GPU machine's 16 cores: a host
    # with fewer cores steps slower); the others are solved on the first point of each technique
    # that ran alone, the rest held out (BENCHMARKS.md section 10). optimizer_8bit is 1.5 times
    # what bitsandbytes' 8-bit step took alone (4.0e-11 s a weight). qlora came out 0: the 8B
    # QLoRA point trained as fast as the plain LoRA rate predicts; liger/lora is negative:
    # Liger's kernels made the 8B LoRA step faster.
    "optimizer_8bit": 6.10583e-11,
    "offload2_step": 2.41491e-10,
    "offload2_micro": 2.98518e-10,
    "liger/full": 2.08853e-14,
    "liger/lora": -4.25049e-14,
    "qlora": 0.0,
    # The grid of issue 21 (bench/gpu/fit_cost.py); flop/lora refitted by cards.py fit-cost on
    # that grid's LoRA points that ran alone (the first fit, on shared points, was 15-20 % slow).
    "cast": 0.0,
    "flop/full": 1.57502e-15,
    "flop/lora": 2.66571e-15,
    "layer": 0.00310971,
    "offload_micro": 2.38209e-10,
    "offload_step": 7.30317e-10,
    "optimizer": 1.68427e-11,
    "zero2": 7.05865e-11,
    "zero3": 1.91366e-10,
    "zero3_layer": 0.0144439,
}

# Communication, from BENCHMARKS.md section 1 (2 H200s, NVLink, NCCL 296.8 GB/s bus bandwidth in
# section 2): plain DDP's step grew by 20 ms (0.5B) and 34 ms (1.5B) over one GPU, where the fp32
# gradients' ring all-reduce takes 6.7 and 20.9 ms at that bandwidth. Two points, two unknowns:
# the step grows by 0.99 x the all-reduce time (no overlap with the backward) plus 13 ms. So the
# model overlaps nothing (`overlap` 0; the project's ds_config sets overlap_comm false, and no
# ZeRO overlap was measured) and adds `comm_fixed` seconds per step on more than one rank.
COMMUNICATION: dict[str, float] = {
    "overlap": 0.0,
    "comm_fixed": 0.0134,
    "ddp_bucket_bytes": 25 * 1024**2,  # torch DDP's default bucket: one all-reduce each
    "ds_bucket_bytes": 5e8,  # roles/run_config run_config_ds_bucket_size
}
# Bytes of a gradient in the all-reduce: LLaMA-Factory upcasts trainable weights to fp32 without
# DeepSpeed (measured: 2.0 GB all-reduced for the 0.5B); DeepSpeed's engine reduces and gathers
# in the run's precision: bf16 or fp16 on GPUs, fp32 on CPUs (bench/links.py measured both).
DDP_GRAD_BYTES = 4.0
HALF_BYTES, FULL_BYTES = 2.0, 4.0

# ZeRO-3 keeps a gathered weight for its backward when the forward and the backward uses are
# closer than stage3_max_reuse_distance parameters (roles/run_config: 1e9): a layer's two uses
# are about 2 x params x (the layers after it / all layers) apart, so the last 1e9 / (2 params)
# of the layers are not gathered again; a model of 0.5B or fewer parameters never is
# (bench/links.py on 2 x 2 ranks: ZeRO-3 moved what its forward gather and reduce-scatter do).
ZERO3_REUSE_DISTANCE = 1e9


def zero3_regathered(params: float) -> float:
    """The share of the weights ZeRO-3 gathers again for the backward."""
    return max(0.0, 1.0 - ZERO3_REUSE_DISTANCE / (2.0 * params)) if params > 0 else 0.0


# The stage each cost term was measured with (zero0 is DDP under DeepSpeed, fsdp is planned as
# ZeRO-3: both measured only as what they resemble).
COST_STAGE = {"none": "none", "zero0": "none", "zero1": "zero1", "zero2": "zero2",
              "zero2_offload": "zero2_offload", "zero3": "zero3", "fsdp": "zero3",
              "zero3_offload": "zero3_offload", "zero3_hpz": "zero3",
              "hsdp": "zero3"}  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What a step's time depends on besides the model: fine-tuning type, DeepSpeed stage,
    checkpointing, tokens of one micro-batch, micro-batches per optimizer step, LoRA rank, and
    whether the run trains in 16-bit precision (bf16 or fp16; False: fp32, as on CPUs), the
    ranks of one node (the hybrid stages shard over them), and whether the collectives run over
    gloo (CPU ranks, as on the lab) rather than NCCL."""

    finetuning: str
    stage: str
    checkpointing: bool
    micro_tokens: int
    accumulation: int = 1
    lora_rank: int = 8
    half: bool = True
    technique: Technique = PLAIN
    local_ranks: int = 1
    gloo: bool = False

    @property
    def reduce_scatter(self) -> float:
        """A reduce-scatter's bytes as a multiple of its tensor's on n ranks, per (n-1)/n: gloo's
        moves an all-reduce's (bench/links.py's collectives probe: 66 MiB from each node for a
        44 MiB tensor on 2 x 2 ranks, as its all-reduce; an all-gather 33 MiB), NCCL's half."""
        return 2.0 if self.gloo else 1.0

    @property
    def engine_bytes(self) -> float:
        """Bytes of one value DeepSpeed's engine reduces or gathers."""
        return HALF_BYTES if self.half else FULL_BYTES


def lora_params(shape: Shape, rank: int, heads_ratio: float = 1.0) -> float:
    """Trainable parameters of LoRA of `rank` on every linear layer of the decoder (q, k, v, o,
    gate, up, down): rank x (inputs + outputs) each. Key/value widths are taken as the hidden
    size times heads_ratio (grouped-query attention makes them smaller; the adapter is tiny
    either way)."""
    h, i = shape.hidden, shape.intermediate
    kv = h * heads_ratio
    per_layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)
    return float(rank * per_layer * shape.layers)


def flop_params(shape: Shape) -> float:
    """Parameters that cost FLOPs per token: all but an untied input embedding (a lookup)."""
    return shape.params - (0 if shape.tied else shape.vocab * shape.hidden)


def trainable_params(shape: Shape, setup: Setup) -> float:
    """What the optimizer updates and the gradients hold: every weight, or LoRA's adapter."""
    return shape.params if setup.finetuning == "full" else lora_params(shape, setup.lora_rank)


def features(shape: Shape, setup: Setup, world: int = 1) -> dict[str, float]:
    """The linear terms of one optimizer step's compute time on one of `world` ranks:
    coefficient name -> what it multiplies (the step is their dot product with COEFFICIENTS).
    bench/gpu/fit_cost.py fits the same terms, on one rank. Under ZeRO each rank steps the
    optimizer over its 1/world partition of the weights (bench/links.py measured the saving)."""
    kind = "full" if setup.finetuning == "full" else "lora"
    measured = COST_STAGE[setup.stage]
    a, t = float(setup.accumulation), float(setup.micro_tokens)
    per_token = (6.0 if kind == "full" else 4.0) + (2.0 if setup.checkpointing else 0.0)
    trainable = trainable_params(shape, setup)
    terms = {
        f"flop/{kind}": a * t * per_token * flop_params(shape),
        "layer": a * shape.layers,
    }
    if setup.technique.liger:
        terms[f"liger/{kind}"] = a * t * shape.vocab * shape.hidden
    if setup.technique.quant:
        terms["qlora"] = a * (shape.params - embedding_params(shape))
    if measured == "zero2_offload":
        terms["offload2_step"] = trainable / max(1, world)
        terms["offload2_micro"] = a * shape.params
        terms["zero2"] = a * trainable
        return terms
    if measured == "zero3_offload":
        terms["offload_step"] = trainable
        terms["offload_micro"] = a * shape.params
        terms["zero3_layer"] = a * shape.layers
        return terms
    optimizer = "optimizer_8bit" if setup.technique.optim == "adamw_8bit" else "optimizer"
    shards = setup.local_ranks if setup.stage == "hsdp" else world  # hsdp: a node's ranks
    terms[optimizer] = trainable if measured == "none" else trainable / max(1, shards)
    if measured == "none" and kind == "full":  # autocast casts the fp32 weights to bf16
        terms["cast"] = a * shape.params
    if measured == "zero2":
        terms["zero2"] = a * trainable
    elif measured == "zero1":  # the same copy, once per step (gradients kept whole until then)
        terms["zero2"] = trainable
    elif measured == "zero3":
        terms["zero3"] = a * shape.params
        terms["zero3_layer"] = a * shape.layers
    return terms


def compiled_share(setup: Setup) -> float:
    """What is left of a step's compute under torch.compile: 1 - the share its technique saved
    compiled (planner/techniques.py COMPILE_SAVING); 1 uncompiled. Measured on one GPU: the
    communication is not counted as compiled."""
    if not setup.technique.compiled:
        return 1.0
    return 1.0 - (setup.technique.compile_saving(setup.finetuning) or 0.0)


def dot(terms: Mapping[str, float], coefficients: Mapping[str, float]) -> float:
    """Sum of each term times its coefficient (0 for a name without one)."""
    return sum(coefficients.get(name, 0.0) * value for name, value in terms.items())


@dataclass(frozen=True)
class Link:
    """The link a run's collectives cross: bus bandwidth in bytes/s (ring all-reduce: a
    collective of S bytes over n ranks takes 2 (n-1)/n S / bandwidth), a latency per message
    hop in seconds, and where the figures came from."""

    bandwidth: float
    latency: float
    source: str

    @classmethod
    def from_gbps(cls, gbps: float, latency_ms: float, source: str) -> Link:
        return cls(bandwidth=gbps * 1e9 / 8, latency=latency_ms / 1e3, source=source)


@dataclass(frozen=True)
class Traffic:
    """What one process sends per optimizer step: bytes (as ring all-reduce equivalents:
    already multiplied by 2 (n-1)/n or (n-1)/n) and the number of collectives."""

    wire_bytes: float
    collectives: float
    what: str


def traffic(shape: Shape, setup: Setup, world: int) -> Traffic:
    """Bytes each rank moves per optimizer step across the run's ranks, by stage.

    DDP (none, zero0): the gradients all-reduced once per step (accumulation runs without
    synchronising); ZeRO-1: the same once per step, then the updated weights all-gathered;
    ZeRO-2: the gradients all-reduced every micro-batch, the updated weights all-gathered once
    per step (DeepSpeed 0.19's default use_multi_rank_bucket_allreduce all-reduces the
    partitions' buckets instead of reducing each to its owner: twice a reduce-scatter's bytes,
    measured by bench/links.py); ZeRO-3 (and offload): the weights all-gathered for the forward
    and, where a layer's two uses are farther apart than ZeRO-3 keeps a weight
    (zero3_regathered), again for the backward, and the gradients reduce-scattered (over gloo at
    an all-reduce's bytes: Setup.reduce_scatter), every micro-batch.
    DeepSpeed moves values in the run's precision (Setup.half). LoRA moves the adapter's
    gradients only, except under ZeRO-3, which shards and gathers the frozen weights too.
    """
    if world <= 1:
        return Traffic(0.0, 0.0, "one process: nothing to exchange")
    n = float(world)
    ring = 2 * (n - 1) / n  # all-reduce
    half = (n - 1) / n  # reduce-scatter or all-gather
    a = float(setup.accumulation)
    trainable = trainable_params(shape, setup)
    measured = COST_STAGE[setup.stage]
    c = COMMUNICATION
    if measured == "none":
        size = trainable * DDP_GRAD_BYTES
        return Traffic(
            ring * size,
            max(1.0, size / c["ddp_bucket_bytes"]),
            "gradients (fp32) all-reduced once per optimizer step",
        )
    grads = trainable * setup.engine_bytes
    buckets = max(1.0, grads / c["ds_bucket_bytes"])
    if measured == "zero1":
        weights = trainable * setup.engine_bytes
        return Traffic(
            ring * grads + half * weights,
            2 * buckets,
            "gradients all-reduced and weights gathered once per optimizer step",
        )
    if measured in ("zero2", "zero2_offload"):
        weights = trainable * setup.engine_bytes
        return Traffic(
            a * ring * grads + half * weights,
            a * buckets + buckets,
            "gradients all-reduced every micro-batch, weights gathered once per step",
        )
    weights = shape.params * setup.engine_bytes
    if setup.stage in ("zero3_hpz", "hsdp"):
        return hybrid_traffic(shape, setup, world, weights, grads)
    again = zero3_regathered(shape.params)
    return Traffic(
        a * half * ((1 + again) * weights + setup.reduce_scatter * grads),
        a * ((1 + again) * shape.layers + buckets),
        f"weights gathered for the forward ({again:.0%} again for the backward) and gradients "
        "reduce-scattered, every micro-batch",
    )


def hybrid_traffic(shape: Shape, setup: Setup, world: int, weights: float, grads: float) -> Traffic:
    """What the hybrid stages move between nodes per optimizer step (their gathers inside a node
    are not on the link), on `world` ranks of `setup.local_ranks` per node.

    ZeRO++ hpZ (zero3_hpz): ZeRO-3's forward all-gather and gradient reduce-scatter over every
    rank, every micro-batch; the backward's all-gather comes from the node's secondary copy. It
    saves what ZeRO-3 gathers again for the backward: nothing on a model ZeRO-3 keeps gathered
    (zero3_regathered 0, 0.5B parameters or fewer).
    FSDP's hybrid shard (hsdp): inside a node, ZeRO-3's gathers and reduce-scatter; across nodes
    each rank all-reduces its 1/local shard of the gradients with the same shard of every other
    node, every micro-batch (the trainer's accumulation was not measured), the node's ranks
    sharing its link: the link carries a ring all-reduce of the whole gradients over the nodes."""
    a = float(setup.accumulation)
    n = float(world)
    buckets = max(1.0, grads / COMMUNICATION["ds_bucket_bytes"])
    if setup.stage == "zero3_hpz":
        return Traffic(
            a * (n - 1) / n * (weights + setup.reduce_scatter * grads),
            a * (shape.layers + buckets),
            "weights gathered for the forward across nodes (the backward's from the node's own "
            "copy) and gradients reduce-scattered, every micro-batch",
        )
    nodes = max(1.0, n / max(1, setup.local_ranks))
    return Traffic(
        a * 2 * (nodes - 1) / nodes * grads,
        a * buckets,
        "gradient shards all-reduced across nodes every micro-batch (the gathers stay inside "
        "each node)",
    )


def communication_seconds(moved: Traffic, link: Link | None, world: int) -> float | None:
    """Seconds a step spends communicating (not overlapped), or None without a link figure."""
    if moved.wire_bytes == 0:
        return 0.0
    if link is None:
        return None
    hops = 2 * (world - 1)  # a ring collective's steps, each one message latency
    seconds = moved.wire_bytes / link.bandwidth + moved.collectives * hops * link.latency
    return (1 - COMMUNICATION["overlap"]) * seconds + COMMUNICATION["comm_fixed"]


@dataclass(frozen=True)
class StepCost:
    """One optimizer step of one process, seconds by part; communication None: not known."""

    compute: float
    communication: float | None
    traffic: Traffic
    tokens: int

    @property
    def total(self) -> float:
        return self.compute + (self.communication or 0.0)

    def tokens_per_second(self, world: int) -> float:
        """The run's tokens per second: every rank's tokens of one step over the step time."""
        return self.tokens * world / self.total


def step_cost(
    shape: Shape,
    setup: Setup,
    *,
    world: int,
    link: Link | None,
    coefficients: Mapping[str, float] = COEFFICIENTS,
) -> StepCost:
    """The predicted time of one optimizer step (see the module docstring)."""
    moved = traffic(shape, setup, world)
    return StepCost(
        compute=dot(features(shape, setup, world), coefficients) * compiled_share(setup),
        communication=communication_seconds(moved, link, world),
        traffic=moved,
        tokens=setup.micro_tokens * setup.accumulation,
    )


def mfu(cost: StepCost, shape: Shape, finetuning: str) -> float:
    """Model FLOPs utilisation of the step against PEAK_FLOPS (6 N or 4 N per token, no
    recompute counted: what the grid's MFU column reports)."""
    per_token = 6.0 if finetuning == "full" else 4.0
    return per_token * flop_params(shape) * cost.tokens / cost.total / PEAK_FLOPS
