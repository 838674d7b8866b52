"""What a user can give: one schema for LLaMA-Factory's training arguments and the run's own
inputs, and one message listing every bad value (`check_request`).

The names LLaMA-Factory accepts (its training arguments, its chat templates) are its own,
generated from the pinned release into llamafactory_names.json by scripts/llamafactory-names.py:
an unknown train_args key or model_template is refused here, naming the closest names, instead
of stopping every rank after the run directories were written.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CATALOGUE_FILE, TRAINING_FILE, PlanError
from .techniques import NUMERICS, QUANTIZATION_BITS

FINETUNING_TYPES = ("lora", "freeze", "full")
# What -e deepspeed may name besides auto: plain DDP, the DeepSpeed stages roles/run_config renders
# a ds_config.json for (its vars/main.yml), and FSDP; zero3_hpz (ZeRO++ hpZ) and hsdp (FSDP's
# hybrid shard) shard inside a node and replicate across nodes (planner/search.py: HYBRID).
DEEPSPEED_STAGES = (
    "none",
    "zero0",
    "zero1",
    "zero2",
    "zero2_offload",
    "zero3",
    "zero3_hpz",
    "zero3_offload",
    "fsdp",
    "hsdp",
)
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target")


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


@dataclass(frozen=True)
class Choice:
    """One of a few values (numbers given as text, as -e key=value gives them, are read as
    numbers where the choices are numbers)."""

    values: tuple[Any, ...]
    note: str = ""

    def describe(self) -> str:
        """What is allowed, in words."""
        text = "one of " + ", ".join(str(v) for v in self.values)
        return text + (f" ({self.note})" if self.note else "")

    def coerce(self, value: Any) -> Any:  # noqa: ANN401 - any user value
        """The value as one of the choices; ValueError when it is none."""
        for choice in self.values:
            if isinstance(choice, int) and not isinstance(value, bool):
                try:
                    if _as_number(value) == choice:
                        return choice
                except ValueError:
                    continue
            elif isinstance(value, str) and value.strip().lower() == str(choice):
                return choice
        raise ValueError


def as_flag(value: object) -> bool:
    """A setting's boolean as YAML gives it, or as -e does (a string: "1", "true", "yes", "on"
    are true). Lenient, for the project's own settings; a user's request is checked by Flag."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


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

# LLaMA-Factory 0.9.5's own names (scripts/llamafactory-names.py writes the file).
NAMES_FILE = Path(__file__).with_name("llamafactory_names.json")
NAMES_SHOWN = "llama.cluster/plugins/module_utils/planner/llamafactory_names.json"


@functools.cache
def llamafactory_names() -> dict[str, Any]:
    """LLaMA-Factory's version, training argument names and template names (the pinned
    release's, as scripts/llamafactory-names.py read them)."""
    data = json.loads(NAMES_FILE.read_text(encoding="utf-8"))
    return {
        "version": str(data["llamafactory"]),
        "train_args": frozenset(data["train_args"]),
        "templates": frozenset(data["templates"]),
    }


def closest(word: str, names: frozenset[str]) -> str:
    """The names closest to `word` in words ("closest: a, b"), or "" when none is close."""
    near = difflib.get_close_matches(word, sorted(names), n=3, cutoff=0.6)
    return f" (closest: {', '.join(near)})" if near else ""


# train_args keys the plan sets itself, each with the way to ask for what it holds: a value
# given in train_args would be replaced without a word.
PLAN_OWNED = {
    "model_name_or_path": "ask for the model with -e model_path=<hub id or directory>",
    "template": "ask for the template with -e model_template=<template>",
    "finetuning_type": "ask with -e finetuning_type=lora|freeze|full",
    "lora_target": "ask with -e lora_target=<modules>",
    "dataset": "ask with -e dataset=<names> or -e dataset_file=<path>",
    "dataset_dir": "the run's data is copied into its run directory; -e dataset_file=<path>",
    "output_dir": (
        "every run writes to <cluster_runs_dir>/<run id>/output on every node, and its logs "
        "come back to runs/<run id>/ on the controller"
    ),
    "do_train": "train.yml always trains",
    "deepspeed": "ask with -e deepspeed=<stage>",
    "fsdp": "ask with -e deepspeed=fsdp",
    "fsdp_config": "ask with -e deepspeed=fsdp",
    "tokenized_path": "training_pretokenize in group_vars/all/training.yml decides it",
    "resume_from_checkpoint": (
        "continue a run with -e resume=true [-e run_id=<id>]: from the newest checkpoint every "
        "node holds complete, newer ones set aside"
    ),
    "trust_remote_code": "ask with -e trust_remote_code=true",
    "master_addr": "the launcher sets it: the master's cluster_address",
    "master_port": "the launcher sets it: master_port in the inventory",
    "local_rank": "the launcher sets each process's",
    "ddp_backend": "the accelerator decides it: nccl on GPUs, gloo on CPUs",
}

# train_args keys refused by what they would do (PLAN_OWNED above: what the plan owns), each
# with the supported way. Every other argument (the training's hyper-parameters) passes.
# docs/security.md, "A caller's settings", is this table in words.
UPLOAD = (
    "no run uploads its model or data: bring the run back (playbooks/logs.yml, runs/<run id>/; "
    "a merged model: playbooks/export.yml) and upload it yourself"
)
TRACKING = (
    "experiment trackers are -e report_to=<tensorboard|wandb|mlflow|swanlab>, their settings "
    "tracking_environment and their keys tracking_secrets (docs/after-training.md)"
)
HUB_TOKEN = (
    "the token of a gated model is hf_token (or modelscope_token), sent only to the model hub "
    "and never written into train.yaml (docs/models-and-datasets.md)"
)
OFF_CLUSTER: dict[str, str] = {
    **dict.fromkeys(
        (
            "push_to_hub",
            "hub_model_id",
            "hub_strategy",
            "hub_private_repo",
            "hub_always_push",
            "hub_revision",
            "export_hub_model_id",
        ),
        UPLOAD,
    ),
    **dict.fromkeys(("hub_token", "hf_hub_token", "ms_hub_token", "om_hub_token"), HUB_TOKEN),
    **dict.fromkeys(
        (
            "use_swanlab",
            "swanlab_api_key",
            "swanlab_project",
            "swanlab_workspace",
            "swanlab_run_name",
            "swanlab_mode",
            "swanlab_logdir",
            "swanlab_lark_webhook_url",
            "swanlab_lark_secret",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
        ),
        TRACKING,
    ),
    "ray_init_kwargs": "the cluster's own nodes run the job (llama-job): Ray is not supported",
}
NOT_STAGED = "only the run's model is staged on the nodes: -e model=<name> or -e model_path=<dir>"
OUTSIDE_RUN: dict[str, str] = {
    "adapter_name_or_path": (
        "a run trains the model asked for (-e model=<name>, -e model_path=<dir>); a run goes on "
        "with -e resume=true -e run_id=<id>"
    ),
    "adapter_folder": NOT_STAGED,
    "cache_dir": "the hub cache is the nodes' models directory, cluster_models_dir",
    "logging_dir": "TensorBoard's event files go in the run's output: -e tensorboard=true",
    "offload_folder": "ZeRO-Offload is -e deepspeed=zero2_offload or zero3_offload",
    "profiler_output_dir": "the run's output is its one place to write",
    "export_dir": "playbooks/export.yml writes a merged model",
    "export_quantization_dataset": "playbooks/export.yml merges a run's adapter",
    "media_dir": "a run reads its datasets from its run directory: -e dataset_file=<path>",
    **dict.fromkeys(
        (
            "ref_model",
            "ref_model_adapters",
            "reward_model",
            "reward_model_adapters",
            "kt_weight_path",
            "kt_expert_checkpoint_path",
        ),
        NOT_STAGED,
    ),
}
TRAIN_ARGS_REFUSED = (
    ("is set by the plan, which would replace it: leave it out", PLAN_OWNED),
    ("would send the model, its data or a token off the cluster: refused", OFF_CLUSTER),
    ("would read or write outside the run's directory: refused", OUTSIDE_RUN),
)
# report_to: the trackers the tracking settings support (filter/tracking.py: TRACKERS).
TRACKERS = ("tensorboard", "wandb", "mlflow", "swanlab")

# LLaMA-Factory training arguments (train_args) that are numbers or flags. Other known names
# pass through to LLaMA-Factory, which validates their values itself when the run starts.
TRAIN_ARGS_SCHEMA: dict[str, Number | Flag | Choice] = {
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
    "quantization_bit": Choice((4,), "the QLoRA precision measured: 4"),
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
RUN_SCHEMA: dict[str, tuple[Number | Flag | Choice, str, Any]] = {
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
    "allow_slow_scaling": (Flag(), "-e allow_slow_scaling", False),
    "fp8": (Flag(), "-e fp8", False),
    "quantization_bit": (
        Choice((0, *QUANTIZATION_BITS), "4: QLoRA, 4-bit weights through bitsandbytes"),
        "-e quantization_bit",
        0,
    ),
    "numerics": (
        Choice(NUMERICS, "exact forbids every change of the run's numerics"),
        "-e numerics (training_numerics)",
        "measured",
    ),
}


def _bad(where: str, value: Any, spec: Number | Flag | Choice) -> str:  # noqa: ANN401
    return f"{where} = {show(value)} (must be {spec.describe()})"


def show(value: Any) -> str:  # noqa: ANN401 - any user value
    """The value as the user wrote it: text quoted, unless it reads as a number."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return repr(value)
    return str(value)


def _key_problem(key: object, where: str) -> str | None:
    """What is wrong with a train_args key: not a name, or not one of LLaMA-Factory's."""
    names = llamafactory_names()
    if not isinstance(key, str) or not key.isidentifier():
        return (
            f"{where} key {show(key)} is not an argument name (letters, digits and '_', not "
            "starting with a digit): each key becomes a line of train.yaml"
        )
    if key not in names["train_args"]:
        return (
            f"{where}.{key} is not an argument of LLaMA-Factory {names['version']}"
            f"{closest(key, names['train_args'])}; every name it takes: {NAMES_SHOWN}"
        )
    return None


def check_train_args(
    train_args: Any,  # noqa: ANN401 - user data
    where: str = "train_args",
) -> tuple[dict[str, Any], list[str]]:
    """train_args with its numbers and flags coerced, and a problem for each bad one (a key that
    is not one of LLaMA-Factory's argument names included)."""
    if not isinstance(train_args, Mapping):
        return {}, [
            "train_args must be a mapping of LLaMA-Factory arguments, e.g. "
            '-e \'{"train_args": {"learning_rate": 5.0e-5, "num_train_epochs": 1}}\''
        ]
    checked, problems = {}, []
    for key, value in train_args.items():
        bad_key = _key_problem(key, where)
        if bad_key:
            problems.append(bad_key)
            continue
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
    problems = [
        bad
        for where, args in sources
        for bad in check_train_args(args, where)[1] + _refused_problems(args, where, owned=False)
    ]
    template = str(model.get("template") or "")
    if template:
        problems += template_problems(template, f"the template of the model ({CATALOGUE_FILE})")
    if problems:
        raise PlanError(
            "The project's settings hold values LLaMA-Factory would refuse:\n- "
            + "\n- ".join(problems)
        )


def template_problems(template: str, where: str) -> list[str]:
    """A problem when `template` is not one of LLaMA-Factory's chat templates."""
    names = llamafactory_names()
    if template in names["templates"]:
        return []
    return [
        f"{where} = {show(template)} is not a template of LLaMA-Factory {names['version']}"
        f"{closest(template, names['templates'])}; every template it has: {NAMES_SHOWN}"
    ]


def _refused_problems(
    train_args: object, where: str = "train_args", *, owned: bool = True
) -> list[str]:
    """A problem for each train_args key refused by its category (TRAIN_ARGS_REFUSED: what the
    plan owns, what leaves the cluster, what reaches outside the run's directory), naming the
    supported way; and for a report_to beyond the supported trackers. `owned` False: the
    project's own settings, whose profile rules may set what the plan owns (the stage)."""
    if not isinstance(train_args, Mapping):
        return []
    problems = [
        f"{where}.{key} {why} ({ways[key]})"
        for key in train_args
        for why, ways in TRAIN_ARGS_REFUSED[0 if owned else 1 :]
        if key in ways
    ]
    report_to = train_args.get("report_to", "none")
    names = report_to if isinstance(report_to, list) else str(report_to).split(",")
    others = [str(n).strip() for n in names if str(n).strip() not in (*TRACKERS, "none", "")]
    if others:
        problems.append(
            f"{where}.report_to {', '.join(others)} would send the run's figures to "
            f"a tracker the project does not set up: refused ({TRACKING})"
        )
    return problems


def check_request(
    request: Mapping[str, Any],
    stages: Sequence[str],
    problems: Sequence[str] = (),
) -> dict[str, Any]:
    """The request with its numbers coerced; raises one PlanError listing every problem, the
    model's first (`problems`: what model.find_model found wrong with the model asked for).

    `request` holds what the user asked train.yml for, as llama.cluster.run_plan passes it (model,
    model_path, ..., train_args, cutoff_len, tokens_per_step, max_restarts, model_params_b,
    dataset_records, trust_remote_code, deepspeed).
    """
    out = dict(request)
    problems = list(problems)
    deepspeed = str(request.get("deepspeed") or "auto")
    if deepspeed not in [*stages, "auto"]:
        problems.append(
            f"Unknown deepspeed={json.dumps(deepspeed, ensure_ascii=False)}. "
            f"Use one of: auto, {', '.join(stages)}"
        )
    finetuning = request.get("finetuning_type") or ""
    if finetuning and finetuning not in FINETUNING_TYPES:
        problems.append(
            f"finetuning_type = {show(finetuning)} (must be one of {', '.join(FINETUNING_TYPES)})"
        )
    if request.get("run_id"):
        problems.append(
            f"run_id = {show(request['run_id'])} names a run to continue (-e resume=true -e "
            "run_id=<id>); a new run's id is made by the plan (train-<UTC time>-<model>) and "
            "printed: leave run_id out"
        )
    template = str(request.get("model_template") or "")
    if template:
        problems += template_problems(template, "model_template")
    problems += _refused_problems(request.get("train_args", {}))
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
    # QLoRA asked in train_args is asked for the plan too (the search then plans its memory).
    if out["train_args"].get("quantization_bit") and not out.get("quantization_bit"):
        out["quantization_bit"] = out["train_args"]["quantization_bit"]
    if not isinstance(request.get("model_config") or {}, Mapping):
        problems.append("run_config_model_config must be the parsed config.json (a mapping)")
    if problems:
        raise PlanError(
            "The request cannot be planned:\n- "
            + "\n- ".join(problems)
            + "\nFix these and run again; nothing was changed on any node."
        )
    return out


@dataclass(frozen=True)
class Settings:
    """The project's data the planner reads (group_vars/all/training.yml, models.yml)."""

    catalogue: Mapping[str, Any]
    defaults: Mapping[str, Any]
    rules: Sequence[Mapping[str, Any]]
    memory: Mapping[str, Any]
    compile: Mapping[str, Any]
    stages: Sequence[str]
    # training_shared_storage: every rank writes its checkpoint shards to the one runs directory.
    shared_storage: bool = False
    # training_planning_profiles: the GPUs a CPU cluster may be planned as.
    planning_profiles: Mapping[str, Any] = field(default_factory=dict)
