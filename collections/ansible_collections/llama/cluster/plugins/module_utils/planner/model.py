"""The model: its catalogue entry, the user's overrides, and its size and shape read from
config.json (`resolve_model`, `model_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import CATALOGUE_FILE, PlanError
from .schema import FINETUNING_TYPES, show

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
    """Layers, hidden and MLP sizes, vocabulary and whether the lm_head is the embedding (what
    the activation memory depends on), if known."""
    c = _text_config(config)
    try:
        shape = {
            "layers": int(c["num_hidden_layers"]),
            "hidden": int(c["hidden_size"]),
            "vocab": int(c["vocab_size"]),
        }
        shape["intermediate"] = int(c.get("intermediate_size") or 4 * shape["hidden"])
    except (KeyError, TypeError, ValueError):
        return None
    if not all(v > 0 for v in shape.values()):
        return None
    return {**shape, "tied": bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings")))}


def layer_class(config: Mapping[str, Any]) -> str:
    """The decoder layer class FSDP wraps, for transformers' own architectures ('' if not)."""
    arch = (config.get("architectures") or [""])[0]
    if config.get("auto_map") or not str(arch).endswith("ForCausalLM"):
        return ""
    return str(arch).removesuffix("ForCausalLM") + "DecoderLayer"


def resolve_model(request: Mapping[str, Any]) -> dict[str, Any]:
    """The model entry for this run, with its size and shape.

    The catalogue entry that check_request found (`model_entry`; {} for a model outside the
    catalogue, which gets the defaults) with the -e overrides on top: `path` is -e model_path, or
    the path on every node that llama.cluster.run_plan gives as model_path. The
    config is model_config (the parsed config.json, read by llama.cluster.run_plan) or else the
    catalogue's `config`; the size is -e model_params_b, else the catalogue's params_b, else
    counted from the config.
    Raises when the size cannot be known, or when the config names its own modelling code
    (auto_map) and trust_remote_code was not given.
    """
    name = str(request.get("model") or "")
    entry = dict(request.get("model_entry") or {})
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
            f"{show(model['finetuning_type'])})."
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
