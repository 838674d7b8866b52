"""The run planner: what train.yml runs, decided from the request, the model, every node's GPUs
and the rules kept as data in group_vars/all/training.yml.

Every decision is a small function here with a unit test in tests/test_planner.py:

- the numbers a user gives are checked against one schema (`TRAIN_ARGS_SCHEMA`, `RUN_SCHEMA`);
- the model resolves from the catalogue, `-e` overrides and its config.json (`model_params`);
- every node's GPU memory comes from its facts (the smallest GPU it trains on), the plan from the
  smallest node (`describe_nodes`);
- the DeepSpeed stage, the micro-batch and accumulation, gradient checkpointing and torch.compile
  come from the memory model and the run length (`choose_stage`, `choose_batch`,
  `choose_compile`); the `when`/`set` profile rules add the settings they name (`apply_rules`);
- `plan` puts it together, with the lines shown before launch.

The Jinja filters at the bottom are how roles/run_config/tasks/validate.yml and main.yml call it.
Standard library only; errors are `PlanError` (a filter error in Ansible) with the fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

try:  # Ansible turns a filter error into the task's failure message.
    from ansible.errors import AnsibleFilterError as _BaseError
except ImportError:  # pragma: no cover - the planner is also usable without Ansible
    _BaseError = ValueError  # type: ignore[assignment,misc]

GIB = 1024**3
TRAINING_FILE = "group_vars/all/training.yml"
CATALOGUE_FILE = "group_vars/all/models.yml"
FINETUNING_TYPES = ("lora", "freeze", "full")
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target")


class PlanError(_BaseError):
    """A request, an inventory or a rule the planner cannot plan, with what to change."""


# --------------------------------------------------------------------------------------------
# The numbers a user can give: one schema, one message listing every bad value.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Number:
    """An integer or a real number in a range; `extra` are values allowed outside it."""

    integer: bool
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    extra: tuple[int, ...] = ()
    note: str = ""

    def describe(self) -> str:
        """What is allowed, in words."""
        kind = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{kind} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            text = kind
        if self.extra:
            text += " or " + " or ".join(str(x) for x in self.extra)
        return text + (f" ({self.note})" if self.note else "")

    def coerce(self, value: Any) -> int | float:  # noqa: ANN401 - any user value
        """The value as a number of this kind; ValueError when it is not one in range."""
        number = _as_number(value)
        if self.integer:
            if number != int(number):
                raise ValueError
            number = int(number)
        if number in self.extra:
            return number
        if self.low is not None and (number < self.low or (self.low_open and number == self.low)):
            raise ValueError
        if self.high is not None and (
            number > self.high or (self.high_open and number == self.high)
        ):
            raise ValueError
        return number


@dataclass(frozen=True)
class Flag:
    """true or false (also "true"/"false"/"yes"/"no" as -e key=value gives them)."""

    def describe(self) -> str:
        """What is allowed, in words."""
        return "true or false"

    def coerce(self, value: Any) -> bool:  # noqa: ANN401 - any user value
        """The value as a bool; ValueError when it is none."""
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "false", "no"):
            return value.strip().lower() in ("true", "yes")
        raise ValueError


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def _as_number(value: Any) -> float:  # noqa: ANN401 - any user value
    if isinstance(value, bool) or value is None:
        raise ValueError
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str) and value.strip():
        number = float(value.strip())
    else:
        raise ValueError
    if not math.isfinite(number):
        raise ValueError
    return number


POSITIVE = Number(integer=False, low=0, low_open=True)
AT_LEAST_1 = Number(integer=True, low=1)
AT_LEAST_0 = Number(integer=True, low=0)
FRACTION = Number(integer=False, low=0, high=1, high_open=True)

# LLaMA-Factory training arguments (train_args) that are numbers or flags. Keys not listed pass
# through to LLaMA-Factory unchecked, which validates them itself when the run starts.
TRAIN_ARGS_SCHEMA: dict[str, Number | Flag] = {
    "learning_rate": POSITIVE,
    "num_train_epochs": POSITIVE,
    "max_steps": Number(integer=True, low=1, extra=(-1,), note="-1: train num_train_epochs"),
    "per_device_train_batch_size": AT_LEAST_1,
    "per_device_eval_batch_size": AT_LEAST_1,
    "gradient_accumulation_steps": AT_LEAST_1,
    "logging_steps": AT_LEAST_1,
    "save_steps": AT_LEAST_1,
    "eval_steps": AT_LEAST_1,
    "save_total_limit": AT_LEAST_1,
    "warmup_ratio": FRACTION,
    "warmup_steps": AT_LEAST_0,
    "weight_decay": Number(integer=False, low=0),
    "max_grad_norm": Number(integer=False, low=0, note="0: no clipping"),
    "adam_beta1": FRACTION,
    "adam_beta2": FRACTION,
    "adam_epsilon": POSITIVE,
    "lora_rank": AT_LEAST_1,
    "lora_alpha": AT_LEAST_1,
    "lora_dropout": FRACTION,
    "cutoff_len": AT_LEAST_1,
    "max_samples": AT_LEAST_1,
    "seed": AT_LEAST_0,
    "ddp_timeout": AT_LEAST_1,
    "preprocessing_num_workers": AT_LEAST_1,
    "dataloader_num_workers": AT_LEAST_0,
    **{
        key: Flag()
        for key in (
            "bf16",
            "fp16",
            "pure_bf16",
            "packing",
            "neat_packing",
            "plot_loss",
            "overwrite_output_dir",
            "overwrite_cache",
            "disable_gradient_checkpointing",
            "torch_compile",
            "enable_liger_kernel",
            "save_only_model",
            "save_on_each_node",
            "ddp_find_unused_parameters",
        )
    },
}

# The run's own inputs (-e name=value): schema, where the user sets it, and the value when it
# is not given (None or ""); a default of None means "unknown" (MISSING: required).
MISSING = object()
RUN_SCHEMA: dict[str, tuple[Number | Flag, str, Any]] = {
    "cutoff_len": (
        Number(integer=True, low=1, extra=(0,), note="0: the catalogue's"),
        "-e cutoff_len",
        0,
    ),
    "tokens_per_step": (AT_LEAST_1, "-e tokens_per_step (training_tokens_per_step)", MISSING),
    "max_restarts": (AT_LEAST_0, "-e max_restarts", 0),
    "model_params_b": (POSITIVE, "-e model_params_b (billions of parameters)", None),
    "dataset_records": (AT_LEAST_0, "run_config_dataset_records", None),
    "trust_remote_code": (Flag(), "-e trust_remote_code", False),
}


def _bad(where: str, value: Any, spec: Number | Flag) -> str:  # noqa: ANN401 - any user value
    return f"{where} = {_show(value)} (must be {spec.describe()})"


def _show(value: Any) -> str:  # noqa: ANN401 - any user value
    """The value as the user wrote it: text quoted, unless it reads as a number."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return repr(value)
    return str(value)


def check_train_args(
    train_args: Any,  # noqa: ANN401 - user data
    where: str = "train_args",
) -> tuple[dict[str, Any], list[str]]:
    """train_args with its numbers and flags coerced, and a problem for each bad one."""
    if not isinstance(train_args, Mapping):
        return {}, [
            "train_args must be a mapping of LLaMA-Factory arguments, e.g. "
            '-e \'{"train_args": {"learning_rate": 5.0e-5, "num_train_epochs": 1}}\''
        ]
    checked, problems = {}, []
    for key, value in train_args.items():
        spec = TRAIN_ARGS_SCHEMA.get(str(key))
        if spec is None:
            checked[str(key)] = value
            continue
        try:
            checked[str(key)] = spec.coerce(value)
        except (ValueError, TypeError):
            problems.append(_bad(f"{where}.{key}", value, spec))
    return checked, problems


def check_project_settings(settings: Settings, model: Mapping[str, Any]) -> None:
    """The training arguments the project's own data sets pass the same schema as the user's."""
    sources = [
        (f"training_defaults ({TRAINING_FILE})", settings.defaults),
        (f"{CATALOGUE_FILE} train_args of the model", model.get("train_args") or {}),
    ] + [
        (f"the `set` of profile rule {rule.get('name', '')!r} ({TRAINING_FILE})", rule["set"])
        for rule in settings.rules
    ]
    problems = [bad for where, args in sources for bad in check_train_args(args, where)[1]]
    if problems:
        raise PlanError(
            "The project's settings hold values LLaMA-Factory would refuse:\n- "
            + "\n- ".join(problems)
        )


def check_request(
    request: Mapping[str, Any],
    catalogue: Mapping[str, Any],
    stages: Sequence[str],
) -> dict[str, Any]:
    """The request with its numbers coerced; raises one PlanError listing every problem.

    `request` holds what train.yml passes to the validate entry point (model, model_path, ...,
    train_args, cutoff_len, tokens_per_step, max_restarts, model_params_b, dataset_records,
    trust_remote_code, deepspeed).
    """
    out = dict(request)
    problems: list[str] = []
    name = str(request.get("model") or "")
    if name not in catalogue and not request.get("model_path"):
        head = f"Unknown model {_quote(name)}" if name else "No model given"
        problems.append(
            f"{head}. Known models: {', '.join(sorted(catalogue))} ({CATALOGUE_FILE}). "
            "Use -e model=<one of these>, or give your own with -e model=<name> "
            "-e model_path=<hub id or path on every node> -e model_template=<template>"
        )
    deepspeed = str(request.get("deepspeed") or "auto")
    if deepspeed not in [*stages, "auto"]:
        problems.append(
            f"Unknown deepspeed={_quote(deepspeed)}. Use one of: auto, {', '.join(stages)}"
        )
    finetuning = request.get("finetuning_type") or ""
    if finetuning and finetuning not in FINETUNING_TYPES:
        problems.append(
            f"finetuning_type = {_show(finetuning)} (must be one of {', '.join(FINETUNING_TYPES)})"
        )
    out["train_args"], bad_args = check_train_args(request.get("train_args", {}))
    problems += bad_args
    for key, (spec, where, default) in RUN_SCHEMA.items():
        value = request.get(key)
        if value in (None, "") and default is not MISSING:
            out[key] = default
            continue
        try:
            out[key] = spec.coerce(value)
        except (ValueError, TypeError):
            problems.append(_bad(where, value, spec))
    if not isinstance(request.get("model_config") or {}, Mapping):
        problems.append("run_config_model_config must be the parsed config.json (a mapping)")
    if problems:
        raise PlanError(
            "The request cannot be planned:\n- "
            + "\n- ".join(problems)
            + "\nFix these and run again; nothing was changed on any node."
        )
    return out


def _quote(value: str) -> str:
    return '"' + value.replace('"', '\\"') + '"'


# --------------------------------------------------------------------------------------------
# The model: catalogue entry, overrides, and its size and shape from config.json.
# --------------------------------------------------------------------------------------------

# What the memory model needs from a config.json (or a catalogue entry's `config`).
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (multimodal configs nest it as text_config)."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        return config["text_config"]
    return config


def model_params(config: Mapping[str, Any]) -> int | None:
    """Parameters of a Qwen2/Qwen3/Llama-style decoder from its config.json; None if unknown.

    Counts the embedding (and a separate lm_head unless tie_word_embeddings), per layer the
    attention projections with grouped-query key/value heads of head_dim (Qwen2's q/k/v biases,
    attention_bias, Qwen3's per-head q/k norms), the gated MLP (gate, up, down) and two RMSNorms,
    and the final norm. Mixture-of-experts configs return None (not counted here).
    """
    c = _text_config(config)
    if any(not isinstance(c.get(k), int) or isinstance(c.get(k), bool) for k in SHAPE_KEYS):
        return None
    if not isinstance(c.get("vocab_size"), int) or any(
        c.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
    ):
        return None
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    model_type = str(c.get("model_type", ""))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h
    if model_type == "qwen2":  # Qwen2 always has q/k/v biases and no o_proj bias.
        attention += q + 2 * kv
    elif c.get("attention_bias"):
        attention += q + 2 * kv + h
    if model_type.startswith("qwen3"):  # per-head RMSNorm of queries and keys
        attention += 2 * head_dim
    mlp = 3 * h * c["intermediate_size"]
    if c.get("mlp_bias"):
        mlp += 2 * c["intermediate_size"] + h
    per_layer = attention + mlp + 2 * h
    embeddings = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + h


def model_shape(config: Mapping[str, Any]) -> dict[str, int] | None:
    """Layers, hidden size and vocabulary (what the activation memory depends on), if known."""
    c = _text_config(config)
    try:
        shape = {
            "layers": int(c["num_hidden_layers"]),
            "hidden": int(c["hidden_size"]),
            "vocab": int(c["vocab_size"]),
        }
    except (KeyError, TypeError, ValueError):
        return None
    return shape if all(v > 0 for v in shape.values()) else None


def layer_class(config: Mapping[str, Any]) -> str:
    """The decoder layer class FSDP wraps, for transformers' own architectures ('' if not)."""
    arch = (config.get("architectures") or [""])[0]
    if config.get("auto_map") or not str(arch).endswith("ForCausalLM"):
        return ""
    return str(arch).removesuffix("ForCausalLM") + "DecoderLayer"


def resolve_model(request: Mapping[str, Any], catalogue: Mapping[str, Any]) -> dict[str, Any]:
    """The model entry for this run, with its size and shape.

    The catalogue entry (or defaults, for a model outside it) with the -e overrides on top. The
    config is run_config_model_config (the parsed config.json) or else the catalogue's `config`;
    the size is -e model_params_b, else the catalogue's params_b, else counted from the config.
    Raises when the size cannot be known, or when the config names its own modelling code
    (auto_map) and trust_remote_code was not given.
    """
    name = str(request.get("model") or "")
    entry = dict(catalogue.get(name) or {})
    config = dict(request.get("model_config") or {}) or dict(entry.get("config") or {})
    model = {
        "template": "default",
        "finetuning_type": "lora",
        "lora_target": "all",
        "cutoff_len": 2048,
        "layer_class": layer_class(config),
        "trust_remote_code": False,
        **{k: v for k, v in entry.items() if k != "config"},
    }
    overrides = {
        "path": request.get("model_path"),
        "template": request.get("model_template"),
        "finetuning_type": request.get("finetuning_type"),
        "lora_target": request.get("lora_target"),
    }
    model.update({k: v for k, v in overrides.items() if v})
    cutoff = request.get("train_args", {}).get("cutoff_len") or request.get("cutoff_len")
    if cutoff:
        model["cutoff_len"] = int(cutoff)
    model["cutoff_len"] = int(model["cutoff_len"])
    if request.get("trust_remote_code"):
        model["trust_remote_code"] = True
    model["trust_remote_code"] = bool(model["trust_remote_code"])
    if not model.get("path"):
        raise PlanError(f"Model {name}: no path in {CATALOGUE_FILE}; give -e model_path=...")
    if model["finetuning_type"] not in FINETUNING_TYPES:
        raise PlanError(
            f"Model {name}: finetuning_type must be lora, freeze or full (got "
            f"{_show(model['finetuning_type'])})."
        )
    if config.get("auto_map") and not model["trust_remote_code"]:
        raise PlanError(
            f"Model {name} ({model['path']}): its config.json names its own modelling code "
            "(auto_map), which LLaMA-Factory runs only with trust_remote_code. If you trust "
            "that code, add -e trust_remote_code=true; otherwise pick a model that transformers "
            "supports natively."
        )
    counted = model_params(config) if config else None
    if request.get("model_params_b"):
        model["params_b"], source = float(request["model_params_b"]), "-e model_params_b"
    elif entry.get("params_b"):
        model["params_b"], source = float(entry["params_b"]), CATALOGUE_FILE
    elif counted:
        model["params_b"], source = round(counted / 1e9, 4), "counted from config.json"
    else:
        raise PlanError(
            f"Model {name or model['path']} ({model['path']}): its size is unknown (no params_b "
            f"in {CATALOGUE_FILE} and no config.json with a shape to count from), and the "
            "DeepSpeed stage, micro-batch and checkpointing depend on it. Give the size in "
            "billions of parameters, e.g. -e model_params_b=7.6, or add the model to the "
            "catalogue."
        )
    model["params_source"] = source
    model["shape"] = model_shape(config) if config else None
    return model


# --------------------------------------------------------------------------------------------
# The nodes: accelerator, processes and GPU memory, from the inventory and each node's facts.
# --------------------------------------------------------------------------------------------


def _get(mapping: Any, key: str, default: Any = None) -> Any:  # noqa: ANN401 - Ansible's hostvars
    return mapping.get(key, default) if isinstance(mapping, Mapping) else default


def local_facts(hostvars: Any) -> Mapping[str, Any]:  # noqa: ANN401 - Ansible's hostvars
    """The node's llama_host local fact (roles/host_facts), from gathering or the fact cache."""
    facts = _get(hostvars, "ansible_local")
    if not isinstance(facts, Mapping):
        gathered = _get(hostvars, "ansible_facts", {}) or {}
        facts = _get(gathered, "local") or _get(gathered, "ansible_local") or {}
    return _get(facts, "llama_host", {}) or {}


def node_accelerator(hostvars: Any) -> str:  # noqa: ANN401 - Ansible's hostvars
    """The node's cluster_accelerator (nvidia unless the inventory says otherwise)."""
    return str(_get(hostvars, "cluster_accelerator", "nvidia") or "nvidia")


def cluster_accelerator(hosts: Sequence[str], hostvars: Any) -> str:  # noqa: ANN401
    """The one accelerator every node trains on; raises naming the nodes when they disagree."""
    seen: dict[str, list[str]] = {}
    for host in hosts:
        seen.setdefault(node_accelerator(hostvars[host]), []).append(host)
    if len(seen) > 1:
        raise PlanError(cluster_accelerator_message(seen))
    return next(iter(seen)) if seen else "nvidia"


def hosts_without_gpu_facts(hosts: Sequence[str], hostvars: Any) -> list[str]:  # noqa: ANN401
    """GPU nodes whose facts are neither gathered nor cached: validate.yml reads them first."""
    return [
        host
        for host in hosts
        if node_accelerator(hostvars[host]) != "cpu"
        and not isinstance(local_facts(hostvars[host]).get("gpus"), list)
    ]


def node_gpu_memory(host: str, hostvars: Any) -> tuple[float | None, str]:  # noqa: ANN401
    """GiB of the smallest GPU this node trains on (gpu_ids), and where the figure came from."""
    if node_accelerator(hostvars) == "cpu":
        return None, "CPU node"
    gpus = [g for g in local_facts(hostvars).get("gpus") or [] if isinstance(g, Mapping)]
    wanted = _get(hostvars, "gpu_ids")
    if wanted and gpus:
        indexes = [g.get("index") for g in gpus]
        missing = [i for i in wanted if i not in indexes]
        if missing:
            raise PlanError(
                f"{host}: gpu_ids {list(wanted)} name GPUs {missing} that the node does not have "
                f"(its facts list GPUs {indexes}). Fix gpu_ids in the inventory."
            )
        gpus = [g for g in gpus if g.get("index") in wanted]
    sizes = [int(g["memory_mib"]) for g in gpus if g.get("memory_mib")]
    if sizes:
        which = "GPU" if len(sizes) == 1 else f"smallest of {len(sizes)} GPUs"
        return round(min(sizes) / 1024, 1), f"facts, {which}"
    fallback = _get(hostvars, "training_gpu_memory_gib")
    try:
        gib = POSITIVE.coerce(fallback)
    except (ValueError, TypeError):
        raise PlanError(
            f"{host}: its facts report no GPU memory (no driver loaded, or provision.yml has not "
            f"run there) and training_gpu_memory_gib = {_show(fallback)} is not a number > 0. "
            "Run provision.yml, or set training_gpu_memory_gib to the GPUs' memory in GiB."
        ) from None
    return float(gib), "training_gpu_memory_gib (the facts report no GPU memory)"


def describe_nodes(
    ranks: Mapping[str, int],
    hostvars: Any,  # noqa: ANN401 - Ansible's hostvars
    nprocs: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """Every node in rank order: host, rank, accelerator, processes, GPU memory and its source."""
    nodes = []
    for host, rank in sorted(ranks.items(), key=lambda item: item[1]):
        gib, source = node_gpu_memory(host, hostvars[host])
        nodes.append(
            {
                "host": host,
                "rank": int(rank),
                "accelerator": node_accelerator(hostvars[host]),
                "nproc": nprocs[host],
                "gpu_memory_gib": gib,
                "memory_source": source,
            }
        )
    return nodes


def check_nodes(nodes: Sequence[Mapping[str, Any]]) -> tuple[str, int, int]:
    """The accelerator, processes per node and world size; raises on what cannot be planned."""
    if not nodes:
        raise PlanError("The inventory has no hosts in the group 'cluster'.")
    accelerators = {}
    for node in nodes:
        accelerators.setdefault(node["accelerator"], []).append(node["host"])
    if len(accelerators) > 1:
        raise PlanError(cluster_accelerator_message(accelerators))
    bad = [f"{n['host']}: {_show(n['nproc'])}" for n in nodes if not _is_count(n["nproc"])]
    if bad:
        raise PlanError(
            f"nproc_per_node must be an integer >= 1 (got {', '.join(bad)}): it is the number of "
            "training processes on the node, one per GPU it trains on."
        )
    counts = {int(n["nproc"]) for n in nodes}
    if len(counts) > 1:
        listed = ", ".join(f"{n['host']}: {n['nproc']}" for n in nodes)
        raise PlanError(
            f"Nodes run different numbers of processes ({listed}). torchrun's static rendezvous "
            "needs the same nproc_per_node on every node: set nproc_per_node (or gpu_ids) so that "
            "they match, or leave the smaller nodes out of the cluster group."
        )
    nproc = counts.pop()
    return next(iter(accelerators)), nproc, nproc * len(nodes)


def cluster_accelerator_message(accelerators: Mapping[str, list[str]]) -> str:
    """The refusal for nodes that disagree on cluster_accelerator."""
    found = "; ".join(f"{acc} on {', '.join(hosts)}" for acc, hosts in sorted(accelerators.items()))
    return (
        f"The nodes disagree on cluster_accelerator ({found}). One run trains on one kind of "
        "device: set cluster_accelerator once for the whole cluster group, or fix the host "
        "variables of the nodes that differ."
    )


def _is_count(value: Any) -> bool:  # noqa: ANN401 - any user value
    try:
        AT_LEAST_1.coerce(value)
    except (ValueError, TypeError):
        return False
    return True


# --------------------------------------------------------------------------------------------
# The memory model (coefficients: training_memory in group_vars/all/training.yml).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """Bytes a run needs on each GPU (the fitting formula of BENCHMARKS.md), and its budget."""

    params: float
    finetuning: str
    shape: Mapping[str, int] | None
    world: int
    coefficients: Mapping[str, Any]
    budget: float | None

    def state(self, stage: str) -> float:
        """Weights, gradients and optimizer states (and DDP's gradient buckets) per GPU."""
        c, n, world = self.coefficients, self.params, self.world
        per_param = float(c["state_bytes_per_param"][self.finetuning])
        if self.finetuning != "full":  # frozen bf16 weights; the adapter's states are small
            if stage in ("zero3", "fsdp"):
                return per_param * n / world + self.gathered()
            return self.gathered() if stage == "zero3_offload" else per_param * n
        if stage in ("none", "zero0"):  # DDP keeps a second copy of the fp32 gradients
            buckets = float(c["ddp_bucket_bytes_per_param"]) * n if world > 1 else 0.0
            return per_param * n + buckets
        if stage == "zero2":  # bf16 weights kept; fp32 master weights, grads and Adam sharded
            return 2 * n + (per_param - 2) * n / world
        if stage in ("zero3", "fsdp"):
            return per_param * n / world + self.gathered()
        return self.gathered()  # zero3_offload: weights and optimizer states in CPU memory

    def gathered(self) -> float:
        """bf16 weights ZeRO-3 gathers at once (stage3_max_live_parameters, at most all)."""
        return 2.0 * min(self.params, float(self.coefficients["zero3_live_params"]))

    def activations(self, tokens: int, checkpointing: bool) -> float | None:
        """Activations and logits of one micro-batch of `tokens` tokens (None: shape unknown)."""
        if self.shape is None:
            return None
        layers, hidden, vocab = self.shape["layers"], self.shape["hidden"], self.shape["vocab"]
        if checkpointing:
            c = self.coefficients["checkpointed_bytes"]
            per_token = (
                c["layer_hidden"] * layers * hidden + c["hidden"] * hidden + c["vocab"] * vocab
            )
        else:
            c = self.coefficients["activation_bytes"]
            per_token = c["layer_hidden"] * layers * hidden + c["vocab"] * vocab
        return float(tokens) * per_token

    def need(self, stage: str, tokens: int, checkpointing: bool) -> float:
        """State plus activations (state alone while the shape is unknown)."""
        return self.state(stage) + (self.activations(tokens, checkpointing) or 0.0)

    def fits(self, stage: str, tokens: int, checkpointing: bool) -> bool:
        """Whether that fits the budget (always, without a budget: CPU runs)."""
        return self.budget is None or self.need(stage, tokens, checkpointing) <= self.budget


def _gib(value: float | None) -> str:
    return "unknown" if value is None else f"{value / GIB:.1f} GiB"


# --------------------------------------------------------------------------------------------
# Decisions.
# --------------------------------------------------------------------------------------------

STAGE_ORDER = {
    # Never ZeRO-3 while a smaller stage fits: it gathers every layer's weights over the network
    # on every step (BENCHMARKS.md rule 8). ZeRO-2 shards nothing a LoRA run holds a lot of.
    "full": ("none", "zero2", "zero3", "zero3_offload"),
    "lora": ("none", "zero3", "zero3_offload"),
    "freeze": ("none", "zero3", "zero3_offload"),
}


def choose_stage(memory: Memory, cutoff: int, accelerator: str) -> tuple[str, str]:
    """The DeepSpeed stage for `deepspeed=auto`, and why.

    The first stage of STAGE_ORDER whose state plus one checkpointed row of cutoff_len tokens
    (the smallest micro-batch any plan can use) fits the budget.
    """
    if accelerator == "cpu" or memory.budget is None:
        return "none", "CPU cluster: plain DDP over gloo"
    skipped = []
    for stage in STAGE_ORDER[memory.finetuning]:
        need = memory.need(stage, cutoff, checkpointing=True)
        if need <= memory.budget:
            why = f"{_gib(need)} needed at the smallest micro-batch, budget {_gib(memory.budget)}"
            return stage, why + ("; " + ", ".join(skipped) + " would not fit" if skipped else "")
        skipped.append(f"{stage} ({_gib(need)})")
    raise PlanError(
        f"The model does not fit the GPUs even with ZeRO-3 and CPU offload: one row of "
        f"cutoff_len={cutoff} tokens needs {_gib(need)} per GPU, the budget is "
        f"{_gib(memory.budget)}. Lower cutoff_len (-e cutoff_len=...)."
    )


@dataclass(frozen=True)
class BatchRequest:
    """What the batch rule starts from; None where nobody set the value."""

    cutoff: int
    tokens_per_step: int
    packing: bool
    micro: int | None = None
    accumulation: int | None = None
    checkpointing: bool | None = None
    default_micro: int = 1
    default_accumulation: int = 1


@dataclass(frozen=True)
class Batch:
    """Micro-batch, accumulation and checkpointing, why, and the memory they need."""

    micro: int
    accumulation: int
    checkpointing: bool
    reason: str
    need: float | None = None


def choose_batch(memory: Memory, stage: str, ask: BatchRequest) -> Batch:
    """Micro-batch and accumulation from the tokens per step, and checkpointing from memory.

    With packing a micro-batch is rows of cutoff_len tokens: rows = tokens_per_step / cutoff_len
    per GPU per optimizer step (BENCHMARKS.md rule 2), split into the largest micro-batch that
    fits without gradient checkpointing (rule 3), else the largest that fits with it. Values
    set by the user, a rule or the catalogue are kept. Without packing the micro-batch and
    accumulation come from the settings, and checkpointing still follows memory.
    """
    options = [ask.checkpointing] if ask.checkpointing is not None else [False, True]
    rows = max(1, _round(ask.tokens_per_step / ask.cutoff))
    if not ask.packing or (ask.micro and ask.accumulation):
        micro = ask.micro or ask.default_micro
        accumulation = ask.accumulation or ask.default_accumulation
        why = "as set" if ask.micro or ask.accumulation else "training_defaults: no packing"
        candidates = [(micro, accumulation)]
    else:
        why = f"{rows} packed rows of {ask.cutoff} tokens per process per step"
        if ask.micro:
            micros = [ask.micro]
        elif ask.accumulation:
            micros = list(range(max(1, _round(rows / ask.accumulation)), 0, -1))
        else:  # divisors of rows, largest first: the tokens per step stay exactly as asked
            micros = [m for m in range(rows, 0, -1) if rows % m == 0]
        candidates = [(m, ask.accumulation or max(1, _round(rows / m))) for m in micros]
    if memory.shape is None:  # activations unknown: the smallest micro-batch, recomputed
        micro, accumulation = candidates[-1]
        why += "; model shape unknown (no config.json): smallest micro-batch"
        return Batch(micro, accumulation, options[-1], why, memory.state(stage))
    for checkpointing in options:
        for micro, accumulation in candidates:
            if memory.fits(stage, micro * ask.cutoff, checkpointing):
                need = memory.need(stage, micro * ask.cutoff, checkpointing)
                if len(candidates) > 1:
                    why += (
                        f"; {micro} per micro-batch, the most that fit "
                        + ("with" if checkpointing else "without")
                        + " gradient checkpointing"
                    )
                return Batch(micro, accumulation, checkpointing, why, need)
    micro = candidates[-1][0]
    raise PlanError(
        f"The run does not fit the GPUs: deepspeed={stage} with a micro-batch of {micro} x "
        f"{ask.cutoff} tokens needs about {_gib(memory.need(stage, micro * ask.cutoff, True))} "
        f"per GPU even with gradient checkpointing, and the budget is {_gib(memory.budget)}. "
        "Use deepspeed=auto, a smaller per_device_train_batch_size or cutoff_len, or more GPUs."
    )


def _round(value: float) -> int:
    """Round half up (2.5 -> 3), unlike round()."""
    return math.floor(value + 0.5)


def estimate_steps(
    args: Mapping[str, Any], *, records: int | None, world: int, cutoff: int, record_tokens: int
) -> int | None:
    """Optimizer steps of the run: max_steps, else epochs x records / records per step.

    With packing a row of cutoff_len holds about cutoff_len / record_tokens records.
    """
    max_steps = int(args.get("max_steps") or -1)
    if max_steps > 0:
        return max_steps
    if records is None:
        return None
    if args.get("max_samples"):
        records = min(records, int(args["max_samples"]))
    per_row = max(1.0, cutoff / record_tokens) if args.get("packing") else 1.0
    micro = int(args.get("per_device_train_batch_size", 1))
    per_step = micro * int(args.get("gradient_accumulation_steps", 1)) * world * per_row
    return int(float(args.get("num_train_epochs", 1)) * math.ceil(records / per_step))


def choose_compile(
    accelerator: str, stage: str, steps: int | None, settings: Mapping[str, Any]
) -> tuple[bool, str]:
    """torch.compile when the run is long enough to repay its compilation; never on CPUs."""
    if accelerator == "cpu":
        return False, "never on CPUs"
    if stage != "none":
        return False, "measured with plain DDP only, not with DeepSpeed or FSDP"
    minimum = int(settings["min_optimizer_steps"])
    if steps is None:
        return False, "run length unknown: no max_steps and no dataset record count"
    if steps < minimum:
        return False, f"about {steps} optimizer steps, fewer than the {minimum} that repay it"
    return (
        True,
        f"about {steps} optimizer steps repay ~{settings['compile_seconds']} s of compiling",
    )


# --------------------------------------------------------------------------------------------
# Profile rules (data): `when` (every condition holds) -> `set` (training arguments).
# --------------------------------------------------------------------------------------------

RULE_EQUAL_KEYS = ("accelerator", "finetuning_type", "deepspeed", "model", "stage")
RULE_RANGE_KEYS = ("params_b", "world_size", "nnodes", "gpu_memory_gib", "cutoff_len")
RULE_KEYS = RULE_EQUAL_KEYS + tuple(
    f"{side}_{key}" for key in RULE_RANGE_KEYS for side in ("min", "max")
)


def check_rules(rules: Any) -> list[Mapping[str, Any]]:  # noqa: ANN401 - user data
    """The rules, or a PlanError naming the rule and the key that cannot be tested."""
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise PlanError(f"training_profile_rules ({TRAINING_FILE}) must be a list of rules.")
    for index, rule in enumerate(rules):
        name = rule.get("name", f"#{index + 1}") if isinstance(rule, Mapping) else f"#{index + 1}"
        if (
            not isinstance(rule, Mapping)
            or not isinstance(rule.get("when") or {}, Mapping)
            or not isinstance(rule.get("set"), Mapping)
        ):
            raise PlanError(
                f"Profile rule {name} ({TRAINING_FILE}): needs a `set` mapping (and a `when` "
                "mapping, or none to always apply)."
            )
        unknown = [k for k in rule.get("when") or {} if k not in RULE_KEYS]
        if unknown:
            raise PlanError(
                f"Profile rule {name!r} ({TRAINING_FILE}) tests {', '.join(unknown)}, which no "
                f"rule can test. Keys a rule can test: {', '.join(RULE_KEYS)}."
            )
    return list(rules)


def rule_matches(rule: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
    """Whether every condition of the rule's `when` holds for these facts.

    An equality key matches one value or any of a list; min_<x>/max_<x> bound a number and
    never match a fact that is unknown (gpu_memory_gib on a CPU cluster).
    """
    for key, wanted in (rule.get("when") or {}).items():
        if key in RULE_EQUAL_KEYS:
            if facts.get(key) not in (wanted if isinstance(wanted, list) else [wanted]):
                return False
            continue
        side, name = key.split("_", 1)
        value = facts.get(name)
        if value is None or (side == "min" and value < float(wanted)):
            return False
        if side == "max" and value > float(wanted):
            return False
    return True


def apply_rules(
    rules: Sequence[Mapping[str, Any]], facts: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The settings of every matching rule (later rules win), and the names that matched."""
    settings: dict[str, Any] = {}
    names = []
    for rule in rules:
        if rule_matches(rule, facts):
            settings.update(rule["set"])
            names.append(str(rule.get("name", "")))
    return settings, names


# --------------------------------------------------------------------------------------------
# The plan.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The project's data the planner reads (group_vars/all/training.yml, models.yml)."""

    catalogue: Mapping[str, Any]
    defaults: Mapping[str, Any]
    rules: Sequence[Mapping[str, Any]]
    memory: Mapping[str, Any]
    compile: Mapping[str, Any]
    stages: Sequence[str]


def _smallest(nodes: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    gpu = [n for n in nodes if n["gpu_memory_gib"] is not None]
    return min(gpu, key=lambda n: n["gpu_memory_gib"]) if gpu else None


def _stage_and_profile(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    memory: Memory,
    facts: dict[str, Any],
    settings: Settings,
) -> tuple[str, str, dict[str, Any], list[str]]:
    """The stage and why; the profile rules' settings (after the stage they may test or set)."""
    asked = request.get("deepspeed") or "auto"
    if asked == "auto":
        stage, why = choose_stage(memory, model["cutoff_len"], facts["accelerator"])
        why = f"chosen by the rule in {TRAINING_FILE}: {why}"
    else:
        stage, why = asked, f"deepspeed={asked} given"
    facts["deepspeed"] = stage
    profile, applied = apply_rules(settings.rules, facts)
    ruled = profile.pop("deepspeed", None)
    if ruled and asked == "auto":
        if ruled not in settings.stages:
            raise PlanError(
                f"A profile rule in {TRAINING_FILE} sets deepspeed={ruled}; use one of: "
                f"{', '.join(settings.stages)}."
            )
        stage, why = str(ruled), f"set by a profile rule in {TRAINING_FILE}"
    return stage, why, profile, applied


def _training_args(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    memory: Memory,
    *,
    stage: str,
    explicit: Mapping[str, Any],
    settings: Settings,
) -> tuple[dict[str, Any], dict[str, str], Batch]:
    """The training arguments: defaults < computed (batch, checkpointing, compile) < explicit."""
    merged = {**settings.defaults, **explicit}
    decisions = {}
    computed: dict[str, Any] = {}
    if memory.budget is None:  # CPU: LLaMA-Factory's defaults and the settings
        batch = Batch(1, 1, True, "as set: a CPU run has no GPU memory to plan for")
        decisions["checkpointing"] = "LLaMA-Factory's default on CPUs"
    else:
        ckpt = explicit.get("disable_gradient_checkpointing")
        batch = choose_batch(
            memory,
            stage,
            BatchRequest(
                cutoff=int(model["cutoff_len"]),
                tokens_per_step=int(request["tokens_per_step"]),
                packing=bool(merged.get("packing", False)),
                micro=explicit.get("per_device_train_batch_size"),
                accumulation=explicit.get("gradient_accumulation_steps"),
                checkpointing=None if ckpt is None else not ckpt,
                default_micro=int(settings.defaults.get("per_device_train_batch_size", 1)),
                default_accumulation=int(settings.defaults.get("gradient_accumulation_steps", 1)),
            ),
        )
        computed["per_device_train_batch_size"] = batch.micro
        computed["gradient_accumulation_steps"] = batch.accumulation
        if not batch.checkpointing:
            computed["disable_gradient_checkpointing"] = True
            # Without checkpointing DDP need not search for unused parameters (rule 7).
            computed["ddp_find_unused_parameters"] = False
        decisions["checkpointing"] = (
            "as set"
            if ckpt is not None
            else "model shape unknown: no config.json"
            if memory.shape is None
            else "the activations would not fit without recomputing them"
            if batch.checkpointing
            else "the micro-batch's activations fit without recomputation"
        )
    decisions["batch"] = batch.reason
    steps = estimate_steps(
        {**merged, **computed, **explicit},
        records=request.get("dataset_records"),
        world=memory.world,
        cutoff=int(model["cutoff_len"]),
        record_tokens=int(settings.compile["record_tokens"]),
    )
    accelerator = "cpu" if memory.budget is None else "gpu"
    use, why = choose_compile(accelerator, stage, steps, settings.compile)
    if use:
        computed["torch_compile"] = True
    decisions["torch_compile"] = "as set" if "torch_compile" in explicit else why
    decisions["estimated_steps"] = str(steps)
    return {**settings.defaults, **computed, **explicit}, decisions, batch


def plan(
    request: Mapping[str, Any],
    *,
    nodes: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The run: what every node renders, why, and the lines shown before launch.

    `settings`: catalogue, defaults, rules, memory, compile and stages (see Settings).
    """
    data = Settings(**settings)
    request = check_request(request, data.catalogue, data.stages)
    accelerator, nproc, world = check_nodes(nodes)
    model = resolve_model(request, data.catalogue)
    check_rules(data.rules)
    check_project_settings(data, model)
    smallest = _smallest(nodes)
    gib = smallest["gpu_memory_gib"] if smallest else None
    memory = Memory(
        params=float(model["params_b"]) * 1e9,
        finetuning=model["finetuning_type"],
        shape=model["shape"],
        world=world,
        coefficients=data.memory,
        budget=gib * GIB * float(data.memory["usable_fraction"]) if gib else None,
    )
    train_args = request["train_args"]
    facts = {
        "accelerator": accelerator,
        "finetuning_type": model["finetuning_type"],
        "model": request.get("model"),
        "stage": train_args.get("stage")
        or (model.get("train_args") or {}).get("stage")
        or data.defaults.get("stage"),
        "params_b": float(model["params_b"]),
        "world_size": world,
        "nnodes": len(nodes),
        "gpu_memory_gib": gib,
        "cutoff_len": model["cutoff_len"],
    }
    stage, stage_why, profile, applied = _stage_and_profile(request, model, memory, facts, data)
    explicit = {**profile, **(model.get("train_args") or {}), **train_args}
    explicit.pop("cutoff_len", None)  # model.cutoff_len holds it
    args, decisions, batch = _training_args(
        request, model, memory, stage=stage, explicit=explicit, settings=data
    )
    decisions["deepspeed"] = stage_why
    micro = int(args.get("per_device_train_batch_size", 1))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    tokens = micro * accumulation * int(model["cutoff_len"])
    result = {
        "run_id": request.get("resume_id")
        or f"train-{request.get('timestamp', 'now')}-"
        + re.sub(r"[^A-Za-z0-9_-]+", "-", str(request.get("model") or "model")),
        "resume": bool(request.get("resume_id")),
        "model_name": request.get("model"),
        "model": model,
        "datasets": list(datasets),
        "deepspeed": stage,
        "accelerator": accelerator,
        "nnodes": len(nodes),
        "nproc_per_node": nproc,
        "world_size": world,
        "effective_batch": micro * accumulation * world,
        "tokens_per_step": tokens,
        "tokens_per_optimizer_step": tokens * world,
        "packing": bool(args.get("packing", False)),
        "gradient_checkpointing": not args.get("disable_gradient_checkpointing", False),
        "torch_compile": bool(args.get("torch_compile", False)),
        "gpu_memory_gib": gib,
        "memory_budget_gib": round(memory.budget / GIB, 1) if memory.budget else None,
        "memory_estimate_gib": round(batch.need / GIB, 1) if batch.need else None,
        "nodes": {
            n["host"]: {"gpu_memory_gib": n["gpu_memory_gib"], "memory_source": n["memory_source"]}
            for n in nodes
        },
        "max_restarts": int(request.get("max_restarts") or 0),
        "train_args": args,
        "ranks": dict(ranks),
        "rules_applied": applied,
        "decisions": decisions,
    }
    result["summary"] = summary(result, smallest)
    return result


def _count(params_b: float) -> str:
    """7.62B, 494M, 11,152: a parameter count as people write it."""
    params = params_b * 1e9
    if params >= 1e9:
        return f"{params_b:g}B"
    return f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params:,.0f}"


def summary(plan: Mapping[str, Any], smallest: Mapping[str, Any] | None) -> list[str]:
    """The lines train.yml shows before it touches a node."""
    model = plan["model"]
    args = plan["train_args"]
    lines = [
        f"Run {plan['run_id']}: {plan['model_name']} ({model['path']}), "
        f"{model['finetuning_type']}, {_count(model['params_b'])} parameters "
        f"({model['params_source']})"
        + (
            "; trust_remote_code: the model's own code from its repository runs on every node"
            if model["trust_remote_code"]
            else ""
        ),
        f"Nodes {plan['nnodes']} x {plan['nproc_per_node']} processes = world size "
        f"{plan['world_size']} ({plan['accelerator']})",
        f"Effective batch {plan['effective_batch']} = per-device "
        f"{args.get('per_device_train_batch_size')} x accumulation "
        f"{args.get('gradient_accumulation_steps')} x world size {plan['world_size']}"
        f" ({plan['decisions']['batch']})",
        f"Tokens per optimizer step: {plan['tokens_per_step']} per process x {plan['world_size']}"
        f" = {plan['tokens_per_optimizer_step']} "
        + (
            f"(packed rows of {model['cutoff_len']} tokens)"
            if plan["packing"]
            else f"(at most: samples of up to {model['cutoff_len']} tokens, padded)"
        ),
        f"DeepSpeed: {plan['deepspeed']} ({plan['decisions']['deepspeed']})",
        f"Gradient checkpointing: {'on' if plan['gradient_checkpointing'] else 'off'} "
        f"({plan['decisions']['checkpointing']})",
        f"Packing: {'on' if plan['packing'] else 'off'}; torch.compile: "
        f"{'on' if plan['torch_compile'] else 'off'} ({plan['decisions']['torch_compile']})",
    ]
    if smallest is not None:
        lines.append(
            f"GPU memory planned for: {plan['gpu_memory_gib']} GiB per GPU (smallest node: "
            f"{smallest['host']}, {smallest['memory_source']}); budget "
            f"{plan['memory_budget_gib']} GiB, estimated need "
            f"{plan['memory_estimate_gib'] if plan['memory_estimate_gib'] else 'unknown'} GiB"
        )
    lines.append(f"Restarts after a failure: at most {plan['max_restarts']}")
    lines.append("Datasets: " + ", ".join(d.get("name", "") for d in plan["datasets"]))
    if plan["rules_applied"]:
        lines.append("Profile rules applied: " + "; ".join(plan["rules_applied"]))
    return lines


# --------------------------------------------------------------------------------------------
# Rendering helpers for roles/run_config/tasks/main.yml.
# --------------------------------------------------------------------------------------------


def train_yaml(
    plan: Mapping[str, Any],
    run_dir: str,
    shared_storage: bool = False,
    deepspeed_stages: Sequence[str] = ("zero0", "zero2", "zero3", "zero3_offload"),
) -> dict[str, Any]:
    """What train.yaml holds: the plan's training arguments plus the model, data and paths."""
    model = plan["model"]
    lora = model["finetuning_type"] == "lora"
    args = {k: v for k, v in plan["train_args"].items() if lora or k not in LORA_KEYS}
    args.update(
        {
            "model_name_or_path": model["path"],
            "do_train": True,
            "finetuning_type": model["finetuning_type"],
            "dataset": ",".join(d["name"] for d in plan["datasets"]),
            "dataset_dir": f"{run_dir}/data",
            "template": model["template"],
            "cutoff_len": int(model["cutoff_len"]),
            "output_dir": f"{run_dir}/output",
        }
    )
    if lora:
        args["lora_target"] = model["lora_target"]
    if model.get("trust_remote_code"):
        args["trust_remote_code"] = True
    if plan["deepspeed"] in deepspeed_stages:
        args["deepspeed"] = f"{run_dir}/ds_config.json"
    if plan["deepspeed"] == "fsdp":
        args["fsdp"] = "full_shard auto_wrap"
        args["fsdp_config"] = f"{run_dir}/fsdp_config.json"
    if int(plan["nnodes"]) > 1 and not shared_storage:
        args["save_on_each_node"] = True
    return args


def dataset_info(datasets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """dataset_info.json: one entry per dataset, its file copied beside it as <name>.json."""
    return {
        d["name"]: {
            **{k: v for k, v in d.items() if k not in ("name", "file")},
            "file_name": f"{d['name']}.json",
        }
        for d in datasets
    }


def run_files(texts: Mapping[str, str], run_dir: str) -> list[dict[str, Any]]:
    """The run directory's files for library/llama_files.py: {name: text} -> entries, without
    the empty texts (a configuration the run does not use); a .json file is checked as JSON."""
    return [
        {
            "path": f"{run_dir}/{name}",
            "content": text if text.endswith("\n") else text + "\n",
            "json": name.endswith(".json"),
        }
        for name, text in texts.items()
        if text
    ]


class FilterModule:
    """The run planner's filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "run_config_check": check_request,
            "run_config_accelerator": lambda ranks, hostvars: cluster_accelerator(
                list(ranks), hostvars
            ),
            "run_config_unprobed": lambda ranks, hostvars: hosts_without_gpu_facts(
                list(ranks), hostvars
            ),
            "run_config_nodes": describe_nodes,
            "run_config_plan": plan,
            "run_config_train_yaml": train_yaml,
            "run_config_dataset_info": dataset_info,
            "run_config_files": run_files,
            "model_params": model_params,
        }
