"""The model: its catalogue entry (`find_model`, the one place the catalogue is read), the
user's overrides, its size and shape read from config.json (`resolve_model`, `model_params`), and
where it comes from and lives on every node (`model_stage_source`, `model_stage_probe`,
`model_stage_token_policy`).

Where it comes from: `model_stage_source` turns a catalogue entry (plus the run's overrides) into
a staging request: a hub id to download on every node, a directory of the controller to copy to
every node, or a directory on shared storage to use where it is. `model_stage_token_policy` says
whether the Hugging Face token may go to the endpoint (huggingface.co only, unless the user
trusts a mirror with hf_token_to_endpoint). `model_stage_probe` reads the controller's answer
from the hub (config.json) and pins the request to the commit the hub answered with, or says why
the model cannot be had. Both return an `error` instead of raising, so that the plan fails with
that sentence before any node changes (the run_plan action calls them; roles/model_stage stages
the request). Where the controller cannot reach the hub, the master asks it (train.yml:
`model_stage_headers`, `model_stage_answer`); where neither reaches it, `model_stage_unpinned`
plans a catalogue model with the config its entry carries (`model_stage_reached` tells the two
apart).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlsplit

from .errors import CATALOGUE_FILE, PlanError
from .schema import FINETUNING_TYPES, as_flag, show

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


def find_model(
    catalogue: Mapping[str, Any], name: object, model_path: object = ""
) -> tuple[dict[str, Any], list[str]]:
    """The model's catalogue entry ({} for a model of one's own, given by -e model_path), and
    what is wrong with asking for it ([] when nothing is; check_request lists it with the rest).
    The catalogue is read here only: the action and the planner take the entry from here."""
    name = str(name or "")
    entry = catalogue.get(name)
    if entry is not None or model_path:
        return dict(entry or {}), []
    head = f"Unknown model {json.dumps(name, ensure_ascii=False)}" if name else "No model given"
    return {}, [
        f"{head}. Known models: {', '.join(sorted(catalogue))} ({CATALOGUE_FILE}). "
        "Use -e model=<one of these>, or give your own with -e model=<name> "
        "-e model_path=<hub id or path on every node> -e model_template=<template>"
    ]


def resolve_model(request: Mapping[str, Any], entry: Mapping[str, Any]) -> dict[str, Any]:
    """The model for this run, with its path on every node, its size and shape.

    `entry` is find_model's catalogue entry ({} for a model outside the catalogue, which gets
    the defaults), with the checked request's -e overrides on top: `path` is -e model_path, or
    the path on every node that llama.cluster.run_plan gives as model_path (train.yaml's
    model_name_or_path, roles/run_config). The
    config is model_config (the parsed config.json, read by llama.cluster.run_plan) or else the
    catalogue's `config`; the size is -e model_params_b, else the catalogue's params_b, else
    counted from the config.
    Raises when the size cannot be known, or when the config names its own modelling code
    (auto_map) and trust_remote_code was not given.
    """
    name = str(request.get("model") or "")
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
    model["params_b"], model["params_source"] = _size(request, entry, config, name, model["path"])
    model["shape"] = model_shape(config) if config else None
    return model


def _size(
    request: Mapping[str, Any], entry: Mapping[str, Any], config: Mapping[str, Any], name: str,
    path: str,
) -> tuple[float, str]:  # fmt: skip
    """The model's size in billions of parameters, and where it came from: -e model_params_b,
    else the catalogue's params_b, else counted from the config; refused where none is known."""
    counted = model_params(config) if config else None
    if request.get("model_params_b"):
        return float(request["model_params_b"]), "-e model_params_b"
    if entry.get("params_b"):
        return float(entry["params_b"]), CATALOGUE_FILE
    if counted:
        return round(counted / 1e9, 4), "counted from config.json"
    raise PlanError(
        f"Model {name or path} ({path}): its size is unknown (no params_b "
        f"in {CATALOGUE_FILE} and no config.json with a shape to count from), and the "
        "DeepSpeed stage, micro-batch and checkpointing depend on it. Give the size in "
        "billions of parameters, e.g. -e model_params_b=7.6, or add the model to the "
        "catalogue."
    )


# -- Where the model comes from and where it lives on every node.

HUBS = ("huggingface", "modelscope")
DEFAULT_REVISION = {"huggingface": "main", "modelscope": "master"}
REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Names the staging role keeps for itself inside the models directory.
RESERVED = ("hub",)
TOKEN_VARIABLE = {"huggingface": "hf_token", "modelscope": "modelscope_token"}
# Hosts of the Hugging Face Hub itself: the only ones that get hf_token unless trusted.
HF_HOSTS = ("huggingface.co", "hf.co")


def _safe(name: str) -> str:
    """A repo id or revision as one path component (Qwen/Qwen3-8B -> Qwen--Qwen3-8B)."""
    return name.replace("/", "--")


def _failed(request: dict[str, Any], message: str) -> dict[str, Any]:
    """The request, refused with a sentence that names the model."""
    return {**request, "error": f"Model {request['name']}: {message}"}


def _official_hf_host(endpoint: str) -> bool:
    """Whether an endpoint is the Hugging Face Hub itself, over HTTPS."""
    try:
        parts = urlsplit(endpoint.strip())
        host = (parts.hostname or "").lower().rstrip(".")
    except ValueError:
        return False
    official = any(host == name or host.endswith("." + name) for name in HF_HOSTS)
    return parts.scheme == "https" and official


def model_stage_token_policy(
    hub: str, endpoint: str, token_given: object, to_endpoint: object = False
) -> dict[str, Any]:
    """Whether the hub token goes to `endpoint`: {'send': bool, 'note': why it does not}.

    The Hugging Face token goes to https://huggingface.co (and its subdomains) only: a
    third-party mirror (hf_endpoint=https://hf-mirror.com) would receive the key to the user's
    account with every request. `to_endpoint` (hf_token_to_endpoint) is the user saying they
    trust that endpoint with it. ModelScope's token goes to its endpoint as before.
    """
    if not as_flag(token_given):
        return {"send": False, "note": ""}
    if hub != "huggingface" or _official_hf_host(endpoint) or as_flag(to_endpoint):
        return {"send": True, "note": ""}
    note = (
        f"hf_token is set but not sent to {endpoint}, which is not https://huggingface.co: set "
        "hf_token_to_endpoint=true if you trust that endpoint with your Hugging Face token."
    )
    return {"send": False, "note": note}


def model_stage_source(
    entry: Mapping[str, Any],
    name: str,
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The staging request for one model.

    entry: the catalogue entry with the run's overrides (path, and optionally hub, revision,
    shared, generated, modelscope_path). settings: hub (the default hub), hub_dir (the node
    cache of hub downloads), models_dir (where controller directories are copied to),
    generated_dir (the controller directory of a generated model), endpoints (per hub).
    """
    path = str(entry.get("path") or "").strip()
    request: dict[str, Any] = {"name": name, "error": "", "generated": False}
    if as_flag(entry.get("generated", False)):
        return _local(request, str(settings["generated_dir"]), settings, generated=True)
    if not path:
        return _failed(request, "no path (give a hub id or a directory with -e model_path=...).")
    shared = as_flag(entry.get("shared", False))
    if path.startswith(("/", "~")):
        if shared:
            return _shared(request, path)
        return _local(request, path, settings, generated=False)
    if shared:
        return _failed(
            request,
            f"model_shared is set but {path} is not a directory: shared storage needs the "
            "absolute path of the model on every node.",
        )
    return _hub(request, entry, path, settings)


def _shared(request: dict[str, Any], path: str) -> dict[str, Any]:
    """A directory on storage every node mounts at the same path: used where it is."""
    if not path.startswith("/"):
        return _failed(
            request,
            f"{path} is on shared storage, so it must be an absolute path that every node "
            "reads alike (~ differs between accounts).",
        )
    path = path.rstrip("/") or "/"
    summary = f"{path} on shared storage, used where it is on every node"
    return {**request, "kind": "shared", "source": path, "path": path, "summary": summary}


def _local(
    request: dict[str, Any], path: str, settings: Mapping[str, Any], generated: bool
) -> dict[str, Any]:
    """A directory of the controller: copied into the models directory of every node.

    A user's directory is named there by its name and a digest of its path on the controller
    (`checkpoint-500-<12 hex digits>`): two directories of the same name (.../exp1/checkpoint-500
    and .../exp2/checkpoint-500) are two node directories, never one that rsync --delete turns
    from one into the other. The generated model keeps its catalogue path (the models
    catalogue's `tiny`, which a model server names too)."""
    source = posixpath.normpath(posixpath.expanduser(path)).rstrip("/")
    base = posixpath.basename(source)
    if not base or base.startswith(".") or base in RESERVED:
        return _failed(
            request,
            f"the directory {path} cannot be copied under {settings['models_dir']}: name it "
            f"something other than {', '.join(RESERVED)} or a name starting with '.'.",
        )
    name = base if generated else f"{base}-{source_digest(source)}"
    target = posixpath.join(settings["models_dir"], name)
    made = "generated on the controller" if generated else "the controller's"
    return {
        **request,
        "kind": "controller",
        "generated": generated,
        "source": source,
        "path": target,
        "summary": f"{source} ({made}), copied to {target} on every node that lacks it",
    }


def source_digest(source: str) -> str:
    """The 12 hex digits that tell a controller directory's copy from another of the same name:
    a digest of its absolute, normalised path."""
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def _hub(
    request: dict[str, Any], entry: Mapping[str, Any], path: str, settings: Mapping[str, Any]
) -> dict[str, Any]:
    """A hub id: downloaded once into the hub cache of every node."""
    hub = str(entry.get("hub") or settings["hub"]).strip()
    if hub not in HUBS:
        return _failed(request, f"unknown hub {hub!r}: use model_hub=huggingface or modelscope.")
    repo = str(entry.get("modelscope_path") or path) if hub == "modelscope" else path
    revision = str(entry.get("revision") or DEFAULT_REVISION[hub])
    endpoint = str(settings["endpoints"][hub]).rstrip("/")
    problem = _hub_problem(hub, repo, revision, endpoint)
    if problem:
        return _failed(request, problem)
    quoted = quote(revision, safe="")
    if hub == "huggingface":
        probe_url = f"{endpoint}/{repo}/resolve/{quoted}/config.json"
    else:
        probe_url = f"{endpoint}/api/v1/models/{repo}/repo?Revision={quoted}&FilePath=config.json"
    return {
        **request,
        "kind": "hub",
        "hub": hub,
        "repo": repo,
        "revision": revision,
        "commit": "",
        "endpoint": endpoint,
        "probe_url": probe_url,
        "source": repo,
        "path": posixpath.join(settings["hub_dir"], hub, _safe(repo), _safe(revision)),
    }


def _hub_problem(hub: str, repo: str, revision: str, endpoint: str) -> str:
    """What is wrong with a hub request, or "" when nothing is."""
    variable = "hf_endpoint" if hub == "huggingface" else "modelscope_endpoint"
    rules = [
        (
            not REPO_ID.match(repo),
            f"{repo!r} is neither a hub id (namespace/name, e.g. Qwen/Qwen2.5-7B-Instruct) nor "
            "an absolute path to a directory on the controller.",
        ),
        (
            not REVISION.match(revision) or ".." in revision,
            f"revision {revision!r} is not a branch, tag or commit name.",
        ),
        (
            not re.match(r"^https?://[^/\s]+", endpoint),
            f"{variable}={endpoint!r} is not an http(s) URL (e.g. https://hf-mirror.com).",
        ),
    ]
    return next((message for broken, message in rules if broken), "")


def model_stage_headers(token: object, send: object = True) -> dict[str, str]:
    """The headers that carry a hub token to the endpoint (the Hugging Face Hub reads the bearer,
    ModelScope its session cookie); {} without a token, or where model_stage_token_policy says it
    may not go (send false)."""
    token = str(token or "")
    if not token or not as_flag(send):
        return {}
    return {"Authorization": f"Bearer {token}", "Cookie": f"m_session_id={token}"}


# What model_stage_probe reads of an answer: the rest of a registered result (its invocation,
# which holds the request's headers and so the token) is left behind.
ANSWER_KEYS = ("status", "msg", "content", "x_repo_commit", "x_error_code")
# The hub's config.json is a few kB; a larger answer is not one (read or kept no further).
MAX_ANSWER_BYTES = 4 << 20


def model_stage_answer(registered: object) -> dict[str, Any]:
    """The hub's answer to the master's GET of config.json, as ansible.builtin.uri registered it
    (train.yml asks the master where the controller cannot reach the hub), reduced to what
    model_stage_probe reads; {} when the master was not asked (skipped, or nothing given). A
    master that did not answer (unreachable) is an answer with status -1 that says so."""
    if not isinstance(registered, Mapping) or not registered or registered.get("skipped"):
        return {}
    if registered.get("unreachable"):
        said = " ".join(str(registered.get("msg") or "no answer").split())
        return {"status": -1, "msg": f"Request failed: the master did not answer: {said}"}
    answer = {key: registered[key] for key in ANSWER_KEYS if key in registered}
    if isinstance(answer.get("content"), str):
        answer["content"] = answer["content"][:MAX_ANSWER_BYTES]
    return answer


def model_stage_reached(answer: Mapping[str, Any]) -> bool:
    """Whether the hub answered the GET: no connection (status -1: a name that does not resolve,
    a refused or timed-out connection, TLS) or a gateway's error (5xx) is not an answer about the
    model, a 4xx is."""
    try:
        status = int(answer.get("status") or -1)
    except (TypeError, ValueError):
        return False
    return 0 < status < 500


def model_stage_unpinned(
    request: Mapping[str, Any], config: Mapping[str, Any], answer: Mapping[str, Any], asker: str
) -> dict[str, Any]:
    """A hub request planned without the hub, which did not answer `asker` (the controller, or
    the master as well): with `config`, the fields of config.json that the model's catalogue
    entry carries ({} when the size was given with -e model_params_b instead).

    The nodes then download the revision by its name: pinned only where the revision is itself a
    commit (-e model_revision=<40 hex digits>); otherwise each node downloads it as the hub serves
    it when its download starts, and a node that holds a snapshot of that revision already keeps
    it, so nodes can differ: the summary says so and how to pin one.
    """
    revision, path = request["revision"], request["path"]
    status = int(answer.get("status") or -1)
    reason = _reason(str(answer.get("msg") or "")) if status <= 0 else f"HTTP {status}"
    why = f"neither the controller nor {asker} gets an answer from the hub ({asker}: {reason})"
    if asker == "the controller":
        why = f"the controller gets no answer from the hub ({reason})"
    planned = (
        f"planned with the config that {CATALOGUE_FILE} carries"
        if config
        else "planned from the size given (-e model_params_b), without config.json"
    )
    head = f"{request['repo']} from {request['endpoint']} ({request['hub']}), revision {revision}"
    unpinned = {**request, "config": dict(config), "error": "", "commit": ""}
    if COMMIT.match(revision):
        unpinned["commit"] = revision
        unpinned["summary"] = (
            f"{head} (a commit): {why}; {planned}; every node that lacks it downloads that commit "
            f"into {path}"
        )
        return unpinned
    unpinned["summary"] = (
        f"{head}, not pinned to a commit: {why}; {planned}. Each node downloads {revision} as "
        f"the hub serves it when its download starts, into {path} (a node that has that "
        "directory keeps its snapshot), so nodes can hold different commits: "
        "-e model_revision=<commit> gives every node the same one"
    )
    return unpinned


def _reason(msg: str) -> str:
    """The cause in an error of ansible.builtin.uri, without its preamble."""
    found = re.search(r"Request failed: (.*)", msg or "")
    reason = (found.group(1) if found else msg or "no answer").strip()
    return re.sub(r"^<urlopen error (.*)>$", r"\1", reason)


def _private_hint(token: str, token_given: bool, withheld: str) -> str:
    """How to reach a model that may be private, after "Check the id"."""
    if token_given:
        return "."
    if withheld:
        return f"; if it is private, {withheld}"
    return f", or give {token} if the model is private."


def _refusal(
    request: Mapping[str, Any],
    answer: Mapping[str, Any],
    token_given: bool,
    withheld: str,
    asker: str,
) -> str:
    """Why the hub did not hand out config.json to `asker`, or "" when it did (HTTP 200)."""
    hub, repo, revision = request["hub"], request["repo"], request["revision"]
    token = TOKEN_VARIABLE[hub]
    variable = "hf_endpoint" if hub == "huggingface" else "modelscope_endpoint"
    status = int(answer.get("status") or -1)
    code = str(answer.get("x_error_code") or "")
    content = str(answer.get("content") or "")
    denied = code == "GatedRepo" or (status in (401, 403) and code != "RepoNotFound")
    place = asker if asker == "the controller" else f"the controller, and from {asker}"
    rules = [
        (
            status <= 0,
            f"the endpoint is unreachable from {place} ({_reason(answer.get('msg', ''))}). "
            f"Check {variable} (a mirror, e.g. -e hf_endpoint=https://hf-mirror.com), the proxy "
            "settings and the network.",
        ),
        (
            code == "RevisionNotFound" or (status == 404 and "revision" in content.lower()),
            f"the hub has no revision {revision} of this model.",
        ),
        (
            denied and token_given,
            f"the token ({token}) was refused (HTTP {status}): accept the model's licence on its "
            "page with the account the token belongs to, and check the token.",
        ),
        (denied and bool(withheld), f"the model is gated or private (HTTP {status}); {withheld}"),
        (
            denied,
            f"the model is gated or private (HTTP {status}): give a token with access, e.g. "
            f"-e {token}=... or {token} in an ansible-vault file.",
        ),
        (code == "EntryNotFound", "the model has no config.json: it is not a transformers model."),
        (
            status == 404 or code == "RepoNotFound",
            f"the hub has no model {repo} (HTTP {status}). Check the id"
            + _private_hint(token, token_given, withheld),
        ),
        (status != 200, f"the hub answered HTTP {status} for {request['probe_url']}."),
    ]
    return next((message for matched, message in rules if matched), "")


def model_stage_probe(
    request: Mapping[str, Any],
    answer: Mapping[str, Any],
    token_given: bool,
    hub_dir: str,
    withheld: str = "",
    *,
    asker: str = "the controller",
) -> dict[str, Any]:
    """The request pinned to the hub's commit, with the model's config; or the reason it failed.

    answer: the registered result of ansible.builtin.uri (status, msg, content, and the
    response headers as lower-case keys with '_' for '-'). token_given: a token was sent;
    withheld: model_stage_token_policy's note when one was set but not sent; asker: who asked
    (the controller, or the master where the controller cannot reach the hub).
    """
    where = f"{request['repo']}, revision {request['revision']}, at {request['endpoint']}"
    refused = dict(request, config={})

    def fail(message: str) -> dict[str, Any]:
        if not model_stage_reached(answer):
            message += " Without the hub, -e model_params_b=<billions> plans it from its size."
        return _failed(refused, f"({where}) {message} Nothing was changed on any node.")

    message = _refusal(request, answer, token_given, withheld, asker)
    if message:
        return fail(message)
    try:
        config = json.loads(str(answer.get("content") or ""))
    except ValueError:
        return fail("config.json is not JSON (is the endpoint a model hub?).")
    if not isinstance(config, dict) or config.get("Success") is False:  # ModelScope's refusal
        return fail(f"config.json is not a model configuration: {str(config)[:200]}.")
    commit = str(answer.get("x_repo_commit") or "")
    pinned = {**request, "config": config, "error": ""}
    if COMMIT.match(commit):
        pinned["commit"] = commit
        pinned["path"] = posixpath.join(hub_dir, request["hub"], _safe(request["repo"]), commit)
    pinned["summary"] = (
        f"{request['repo']} from {request['endpoint']} ({request['hub']}), revision "
        f"{request['revision']}{(' = commit ' + commit[:12]) if pinned['commit'] else ''}, "
        f"downloaded once into {pinned['path']} on every node that lacks it"
        + ("" if asker == "the controller" else f" ({asker} asked: the controller cannot reach it)")
    )
    return pinned
