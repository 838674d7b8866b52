"""What playbooks/serve.yml serves and how, and what playbooks/tensorboard.yml opens to whom: the
decisions, each with a unit test in tests/unit/roles/test_serve.py (tracking:
plugins/filter/tracking.py).

- `serve_request`: the -e inputs checked together (what to serve, port, backend, sources);
- `serve_model`: the model directory, adapter, template and name of a run, a catalogue model or
  an export directory;
- `serve_backend`: LLaMA-Factory's HF backend on CPUs, vLLM on GPUs that have it;
- `service_sources`, `service_listen_address` and `service_url_host`: who may reach a
  service's port, the address it listens on (the node's cluster address, never 0.0.0.0), and
  where the controller reaches it;
- `serve_api_key_source`: which API key a server requires (the user's, or one generated on
  first use and kept in a 0600 file on the controller), and what to print about it;
- `export_request`: playbooks/export.yml's -e inputs (run_id, checkpoint, export_dir), which
  become paths on the master, checked on the controller by the same rules as serve.yml's;

Standard library only; errors are `ServeError` (a filter error in Ansible) naming the fix.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.planner.model import REPO_ID
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import (
    as_flag,
    template_problems,
)

try:  # Ansible turns a filter error into the task's failure message.
    from ansible.errors import AnsibleFilterError as _BaseError
except ImportError:  # pragma: no cover - usable without Ansible
    _BaseError = ValueError  # type: ignore[assignment,misc]

BACKENDS = ("auto", "huggingface", "vllm")
STATES = ("present", "absent")
CATALOGUE_FILE = "group_vars/all/models.yml"
SERVE_FILE = "group_vars/all/serve.yml"
SOURCE_RE = re.compile(r"^(any|[0-9a-fA-F.:]+(/[0-9]{1,3})?)$")
# A run's id (a directory name under cluster_runs_dir) and a checkpoint's (under its output).
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
CHECKPOINT_RE = re.compile(r"^checkpoint-[0-9]+$")


class ServeError(_BaseError):
    """A request that cannot be served, with what to change."""


def _port(value: object) -> int | None:
    try:
        port = int(str(value))
    except ValueError:
        return None
    return port if 1 <= port <= 65535 else None


# --------------------------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------------------------
def _service_problems(
    asked: Mapping[str, Any], reserved: Mapping[str, int], prefix: str = "serve"
) -> tuple[dict[str, Any], list[str]]:
    """State, port, backend, sources and restarts of a service request, and what is wrong.

    `prefix` names the variables in the messages (serve_port, tensorboard_port, ...).
    """
    problems: list[str] = []
    state = str(asked.get("state") or "present")
    if state not in STATES:
        problems.append(f"{prefix}_state={state!r}: use present (start) or absent (stop)")
    port = _port(asked.get("port"))
    if port is None:
        problems.append(f"{prefix}_port={asked.get('port')!r}: a TCP port, 1-65535")
    for name, used in reserved.items():
        if port is not None and port == int(used):
            problems.append(f"{prefix}_port={port} is {name} (the cluster's own): choose another")
    backend = str(asked.get("backend") or "auto")
    if backend not in BACKENDS:
        problems.append(f"{prefix}_backend={backend!r}: use {', '.join(BACKENDS)}")
    sources = asked.get("sources") or []
    if isinstance(sources, str) or not isinstance(sources, Sequence):
        problems.append(f"{prefix}_sources must be a list of addresses or CIDRs (got {sources!r})")
        sources = []
    bad = [str(s) for s in sources if not SOURCE_RE.match(str(s))]
    if bad:
        problems.append(
            f"{prefix}_sources {', '.join(bad)}: write 'any', an address or address/prefix"
        )
    try:
        restarts = int(str(asked.get("max_restarts", 0)))
    except ValueError:
        restarts = -1
    if restarts < 0:
        problems.append(f"{prefix}_max_restarts={asked.get('max_restarts')!r}: a count, 0 or more")
    service = {
        "state": state,
        "port": port,
        "backend": backend,
        "sources": [str(s) for s in sources],
        "max_restarts": restarts,
    }
    return service, problems


def _source_problems(
    asked: Mapping[str, Any], catalogue: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """What to serve (a run, a catalogue model or a directory), and what is wrong."""
    problems: list[str] = []
    run_id = str(asked.get("run_id") or "")
    model = str(asked.get("model") or "")
    model_path = str(asked.get("model_path") or "")
    export_dir = str(asked.get("export_dir") or "")
    merged = as_flag(asked.get("merged"))
    checkpoint = str(asked.get("checkpoint") or "")
    given = [n for n, v in (("run_id", run_id), ("model", model), ("export_dir", export_dir)) if v]
    if len(given) > 1:
        problems.append(
            f"{' and '.join('-e ' + g for g in given)}: serve one thing, a run (-e run_id), a "
            "catalogue model (-e model) or a model directory (-e export_dir)"
        )
    source = "dir" if export_dir else "model" if model or model_path else "run"
    if source != "run" and (merged or checkpoint):
        problems.append("-e merged and -e checkpoint pick a run's model: use them with -e run_id")
    problems += path_problems(run_id, checkpoint, export_dir)
    if source == "dir" and not asked.get("model_template"):
        problems.append(
            "-e export_dir needs -e model_template=<LLaMA-Factory template> (the one the "
            "model was trained with, e.g. qwen)"
        )
    # By train.yml's rules: a template of LLaMA-Factory's, a hub id or a plain absolute path.
    template = str(asked.get("model_template") or "")
    if template:
        problems += template_problems(template, "model_template")
    if model_path and not REPO_ID.fullmatch(model_path) and _plain_path_problem(model_path):
        problems.append(
            f"model_path={model_path!r}: a hub id (namespace/name) or an absolute path on the "
            "node, not /, without '.' or '..' parts"
        )
    if source == "model" and model not in catalogue and not model_path:
        problems.append(
            f"Unknown model {model!r}. Known models: {', '.join(sorted(catalogue))} "
            f"({CATALOGUE_FILE}); or -e model=<name> -e model_path=<hub id or path on the node> "
            "-e model_template=<template>"
        )
    what = {
        "source": source,
        "run_id": run_id,
        "model": model,
        "model_path": model_path,
        "model_template": str(asked.get("model_template") or ""),
        "export_dir": export_dir,
        "merged": merged,
        "checkpoint": checkpoint,
        "trust_remote_code": as_flag(asked.get("trust_remote_code")),
    }
    return what, problems


def path_problems(run_id: str, checkpoint: str, export_dir: str) -> list[str]:
    """What is wrong with the -e values that become paths on a node: a run id that is not one
    directory's name, a checkpoint that is not checkpoint-<step>, an export directory that is
    not a plain absolute path ('..' would climb out of it, '/' is the whole disk)."""
    problems = []
    if run_id and (not RUN_ID_RE.match(run_id) or run_id in (".", "..")):
        problems.append(
            f"run_id={run_id!r}: a run's id (letters, digits, '.', '_', '-'), as "
            "playbooks/status.yml lists them"
        )
    if checkpoint and not CHECKPOINT_RE.match(checkpoint):
        problems.append(f"checkpoint={checkpoint!r}: write checkpoint-<step>")
    if export_dir and _plain_path_problem(export_dir):
        problems.append(
            f"export_dir={export_dir!r}: an absolute path on the node, not /, without '.' or "
            "'..' parts (e.g. /data/models/my-model)"
        )
    return problems


def _plain_path_problem(path: str) -> bool:
    """Whether a path is not a plain absolute path on a node: relative, /, with '.' or '..'
    parts ('..' would climb out of it), or holding a line break or a NUL."""
    return (
        not path.startswith("/")
        or path.rstrip("/") == ""
        or posixpath.normpath(path) != path.rstrip("/")
        or path.startswith("//")
        or len(path.splitlines()) > 1
        or any(char in path for char in "\n\r\0")
    )


def export_request(asked: Mapping[str, Any]) -> dict[str, str]:
    """playbooks/export.yml's -e run_id, checkpoint and export_dir, checked on the controller
    before the master is asked anything; one ServeError lists every problem."""
    what = {key: str(asked.get(key) or "") for key in ("run_id", "checkpoint", "export_dir")}
    problems = path_problems(what["run_id"], what["checkpoint"], what["export_dir"])
    if problems:
        raise ServeError(
            "Cannot export:\n- " + "\n- ".join(problems) + "\nNothing was changed on any node."
        )
    return what


def serve_request(
    asked: Mapping[str, Any],
    catalogue: Mapping[str, Any],
    reserved: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The -e inputs of serve.yml, checked together; one ServeError lists every problem.

    `asked` holds state, run_id, model, model_path, model_template, export_dir, merged,
    checkpoint, trust_remote_code, backend, port, sources and max_restarts. `reserved` names
    ports the cluster already uses (master_port, watchdog_port, ...), which a service must not
    take. The result's `source` is `run` (a run's model, with its adapter: the latest run when
    run_id is empty), `model` (a catalogue model) or `dir` (a model directory on the node, e.g.
    an export). Stopping (state absent) needs only a valid port.
    """
    service, problems = _service_problems(asked, reserved or {}, "serve")
    what, more = _source_problems(asked, catalogue)
    problems += more
    stopping = service["state"] == "absent"
    blocking = [p for p in problems if "serve_port" in p] if stopping else problems
    if blocking:
        verb = "stop serving" if stopping else "serve"
        raise ServeError(
            f"Cannot {verb}:\n- " + "\n- ".join(blocking) + "\nNothing was changed on any node."
        )
    return {**service, **what}


def service_request(
    asked: Mapping[str, Any], reserved: Mapping[str, int] | None = None, prefix: str = "service"
) -> dict[str, Any]:
    """A plain service's state, port, sources and restarts (TensorBoard), checked."""
    service, problems = _service_problems(asked, reserved or {}, prefix)
    stopping = service["state"] == "absent"
    blocking = [p for p in problems if f"{prefix}_port" in p] if stopping else problems
    if blocking:
        raise ServeError(
            f"{prefix}:\n- " + "\n- ".join(blocking) + "\nNothing was changed on any node."
        )
    return service


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def serve_model(
    request: Mapping[str, Any],
    catalogue: Mapping[str, Any],
    run: Mapping[str, Any] | None = None,
    name: str = "",
) -> dict[str, Any]:
    """The model to load: path, adapter ('' for none), template, trust_remote_code, name.

    `run` ({run_id, run_dir, plan}) is the run's directory on the master and its plan.json, for
    the `run` source. `must_exist` lists the files on the serving node that prove the model is
    there (checked before anything starts).
    """
    source = request["source"]
    if source == "dir":
        path = request["export_dir"]
        out = {
            "path": path,
            "adapter": "",
            "template": request["model_template"],
            "trust_remote_code": request["trust_remote_code"],
            "name": name or path.rstrip("/").rsplit("/", 1)[-1],
            "what": f"the model in {path}",
        }
    elif source == "model":
        entry = dict(catalogue.get(request["model"]) or {})
        path = request["model_path"] or str(entry.get("path") or "")
        if not path:
            raise ServeError(f"Model {request['model']}: no path in {CATALOGUE_FILE}")
        out = {
            "path": path,
            "adapter": "",
            "template": request["model_template"] or str(entry.get("template") or "default"),
            "trust_remote_code": request["trust_remote_code"]
            or bool(entry.get("trust_remote_code")),
            "name": name or request["model"] or path.rstrip("/").rsplit("/", 1)[-1],
            "what": f"catalogue model {request['model'] or path}",
        }
    else:
        out = _run_model(request, run or {}, name)
    local = out["path"].startswith("/")
    out["must_exist"] = ([out["path"] + "/config.json"] if local else []) + (
        [out["adapter"] + "/adapter_config.json"] if out["adapter"] else []
    )
    out["local"] = local
    return out


def _run_model(request: Mapping[str, Any], run: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A run's model: base + adapter (LoRA), the merged export, or the trained model itself."""
    run_id, run_dir = str(run.get("run_id") or ""), str(run.get("run_dir") or "")
    plan = run.get("plan") or {}
    model = plan.get("model") or {}
    if not run_id or not model.get("path"):
        raise ServeError(f"Run {run_id or '?'}: its plan.json names no model; it cannot be served")
    finetuning = str(model.get("finetuning_type") or "lora")
    checkpoint = request.get("checkpoint") or ""
    tail = f"-{checkpoint}" if checkpoint else ""
    out = {
        "template": str(model.get("template") or "default"),
        "trust_remote_code": bool(model.get("trust_remote_code")),
    }
    if request.get("merged"):
        if finetuning != "lora":
            raise ServeError(
                f"Run {run_id} fine-tuned {finetuning}, not LoRA: nothing was merged; serve the "
                f"run itself (-e run_id={run_id}, without -e merged)"
            )
        out |= {
            "path": f"{run_dir}/merged{tail}",
            "adapter": "",
            "name": name or f"{run_id}-merged",
            "what": f"run {run_id}'s merged model (playbooks/export.yml)",
        }
    elif finetuning == "lora":
        out |= {
            "path": str(model["path"]),
            "adapter": f"{run_dir}/output" + (f"/{checkpoint}" if checkpoint else ""),
            "name": name or run_id,
            "what": f"run {run_id}'s LoRA adapter{' ' + checkpoint if checkpoint else ''} on "
            f"{model['path']}",
        }
    else:
        out |= {
            "path": f"{run_dir}/output" + (f"/{checkpoint}" if checkpoint else ""),
            "adapter": "",
            "name": name or run_id,
            "what": f"run {run_id}'s {finetuning}-tuned model",
        }
    return out


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------
def serve_backend(requested: str, accelerator: str, vllm_version: str = "") -> dict[str, str]:
    """LLaMA-Factory's inference backend for this node, and why.

    auto: vLLM on an NVIDIA node where vllm is installed, else the HF (transformers) backend,
    which runs everywhere. vllm asked for on a CPU node, or where it is not installed, is refused.
    """
    gpu = accelerator != "cpu"
    extra = (
        "add vllm to llamafactory_extras (pinned in llamafactory_extra_versions, "
        "group_vars/all/versions.yml) and run provision.yml --tags llamafactory"
    )
    if requested == "vllm":
        if not gpu:
            raise ServeError(
                "serve_backend=vllm: vLLM serves on NVIDIA GPUs and this node is CPU-only "
                "(cluster_accelerator=cpu); use serve_backend=huggingface or auto"
            )
        if not vllm_version:
            raise ServeError(f"serve_backend=vllm: vllm is not installed on the node; {extra}")
        return {"backend": "vllm", "reason": f"asked for (vllm {vllm_version})"}
    if requested == "huggingface":
        return {"backend": "huggingface", "reason": "asked for"}
    if not gpu:
        return {"backend": "huggingface", "reason": "a CPU node: LLaMA-Factory's HF backend"}
    if vllm_version:
        return {"backend": "vllm", "reason": f"a GPU node with vllm {vllm_version}"}
    return {
        "backend": "huggingface",
        "reason": f"a GPU node without vllm (for faster serving, {extra})",
    }


# --------------------------------------------------------------------------------------------
# Who may reach a service, and where
# --------------------------------------------------------------------------------------------
def service_sources(
    configured: Sequence[str], cluster_addresses: Sequence[str], controller: str = ""
) -> list[str]:
    """The addresses ufw lets reach a service's port.

    The configured sources when there are any; else every cluster node and the controller (the
    address the node sees the controller's connection come from).
    """
    chosen = list(configured) if configured else [*cluster_addresses, controller]
    picked: list[str] = []
    for source in chosen:
        if source and source not in picked:
            picked.append(str(source))
    if not picked:
        raise ServeError(
            "No source may reach the service: set serve_sources (addresses or CIDRs) in "
            f"{SERVE_FILE} or the inventory"
        )
    return picked


def controller_address(ssh_connection: str, route: str) -> str:
    """The controller's address as the node sees it.

    From the node's SSH_CONNECTION ("client port server port") when the play reached it by SSH,
    else from the controller's own route to the node (`ip -o route get ADDR`: "... src X ...").
    """
    parts = ssh_connection.split()
    if len(parts) == 4:
        return parts[0]
    match = re.search(r"\bsrc\s+(\S+)", route)
    return match.group(1) if match else ""


UNSPECIFIED = ("", "0.0.0.0", "::", "[::]")


def service_listen_address(node: Mapping[str, Any]) -> str:
    """The address a service listens on: the node's cluster_address (`node` is its hostvars).

    Never every interface: a server with a public interface would offer an unauthenticated
    TensorBoard, or an API to anyone who learns its key, to the internet wherever ufw is off.
    """
    address = str(node.get("cluster_address") or "").strip()
    if address in UNSPECIFIED:
        raise ServeError(
            f"{node.get('inventory_hostname', 'a node')} has no cluster_address to listen on "
            f"(got {address!r}): set cluster_address to its address on the cluster network."
        )
    return address


def service_url_host(node: Mapping[str, Any]) -> str:
    """Where the controller reaches a service on a node (`node` is its hostvars).

    service_address when the inventory sets it (an address that leads to the node's cluster
    address, e.g. through NAT); otherwise the address the service listens on.
    """
    if node.get("service_address"):
        return str(node["service_address"])
    return service_listen_address(node)


def serve_api_key_source(given: object, file_exists: object, key_file: str) -> dict[str, Any]:
    """Which API key the server requires, and what the play prints about it.

    given: a key was set (serve_api_key: LLAMA_SERVE_API_KEY, a vault or -e); file_exists: the
    controller's key file is there. Returns source (given, file or new), show (print the key:
    only once, when it is made) and hint (the curl header that sends it, without the key).
    """
    if as_flag(given):
        return {
            "source": "given",
            "show": False,
            "hint": "Authorization: Bearer $LLAMA_SERVE_API_KEY",
            "note": "the API key you gave (serve_api_key)",
        }
    hint = f"Authorization: Bearer $(cat {key_file})"
    if as_flag(file_exists):
        return {"source": "file", "show": False, "hint": hint, "note": f"API key in {key_file}"}
    note = f"API key generated now, kept in {key_file} (0600); shown this once"
    return {"source": "new", "show": True, "hint": hint, "note": note}


def url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class FilterModule:
    """Serving and services decisions."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "serve_request": serve_request,
            "service_request": service_request,
            "serve_model": serve_model,
            "serve_backend": serve_backend,
            "service_sources": service_sources,
            "service_controller_address": controller_address,
            "service_url_host": service_url_host,
            "service_listen_address": service_listen_address,
            "serve_api_key_source": serve_api_key_source,
            "export_request": export_request,
            "service_url": url,
        }
