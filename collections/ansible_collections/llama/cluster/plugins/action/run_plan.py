"""llama.cluster.run_plan: a new run of train.yml, checked and planned on the controller before
any node changes. One call does what the first play needs: the request checked once, the model
found (and made, or asked for at its hub), the datasets checked record by record, the nodes read
from the inventory and their facts, and the plan made with the planner (module_utils/planner).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.error import HTTPError

from ansible.errors import AnsibleError
from ansible.module_utils.urls import ConnectionError as UrlConnectionError
from ansible.module_utils.urls import open_url
from ansible.parsing.plugin_docs import read_docstring
from ansible.plugins.action import ActionBase
from ansible_collections.llama.cluster.plugins.module_utils.inventory import (
    cluster_ranks,
    node_nproc,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import (
    RUN_STAMP,
    assemble,
    new_run_id,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    TOKEN_VARIABLE,
    find_model,
    model_stage_probe,
    model_stage_source,
    model_stage_token_policy,
    resolve_model,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    cluster_accelerator,
    describe_nodes,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import (
    DEEPSPEED_STAGES,
    check_request,
)

# The options, their types and defaults are documented once, in the module stub that ansible-doc
# reads (plugins/modules/run_plan.py: an action's documentation lives in a module of its name);
# option_spec reads them there, as ansible-doc does, without importing it.
DOCUMENTED = Path(__file__).resolve().parents[1] / "modules" / "run_plan.py"

TRAINING_SETTINGS = {
    "catalogue": "models_catalogue",
    "defaults": "training_defaults",
    "rules": "training_profile_rules",
    "memory": "training_memory",
    "compile": "training_compile",
}
# The tiny model's generator, and its settings (group_vars/all/models.yml).
TINY_MODEL_SCRIPT = "scripts/make_tiny_model.py"
TINY_MODEL_FLAGS = {
    "tiny_model_seed": "--seed",
    "tiny_model_vocab_size": "--vocab-size",
    "tiny_model_hidden_size": "--hidden",
    "tiny_model_corpus_lines": "--lines",
}
# The hub's config.json is a few kB; a larger answer is not one.
MAX_ANSWER_BYTES = 4 << 20

# A run planned in a second that another run of this controller holds takes a later one.
CLAIM_SECONDS = 60


class Refused(Exception):
    """A request that cannot be planned, with the message the user sees."""


class MasterRead(Exception):
    """The plan needs a config.json that only the master has (O(ask_master))."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def claim_run_id(runs_dir: Path, stamp: str, model: str) -> str:
    """The id of a new run of `model` planned at `stamp`, or of the first later second that no
    run of this controller holds; its directory under runs_dir is made here (mkdir fails where
    another run made it first)."""
    started = datetime.strptime(stamp, RUN_STAMP)
    for later in range(CLAIM_SECONDS):
        run_id = new_run_id(f"{started + timedelta(seconds=later):{RUN_STAMP}}", model)
        try:
            (runs_dir / run_id).mkdir(parents=True)
        except FileExistsError:
            continue
        return run_id
    raise Refused(
        f"Runs of {model} started in each of the {CLAIM_SECONDS} seconds from {stamp} hold "
        f"their directories in {runs_dir}: start this run again in a minute."
    )


def option_spec(documented: Path = DOCUMENTED) -> dict[str, dict[str, Any]]:
    """The argument spec of the documented options (type and default)."""
    options = read_docstring(str(documented), ignore_errors=False)["doc"]["options"]
    return {
        name: {key: value for key, value in option.items() if key in ("type", "default")}
        for name, option in options.items()
    }


def dataset_files(
    datasets: list[Mapping[str, Any]], checked: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The run's datasets, in order, each with the file to train on that its check returned.

    checked maps a dataset name to a check result ({"file": ...}, as llama_dataset_check returns
    it); a dataset without one keeps its file.
    """
    return [
        {**entry, "file": checked[entry["name"]]["file"]}
        if entry["name"] in checked
        else dict(entry)
        for entry in datasets
    ]


def dataset_list(
    asked: Mapping[str, Any],
    catalogue: Mapping[str, Any],
    formats: Mapping[str, Any],
    default: str,
) -> list[dict[str, Any]]:
    """The run's datasets, each a dataset_info entry with its name and file; raises Refused for an
    unknown name or format."""
    names = [n.strip() for n in str(asked["dataset"]).split(",") if n.strip()]
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        raise Refused(
            f"Unknown dataset {', '.join(unknown)}. Known datasets: {', '.join(sorted(catalogue))}"
            " (group_vars/all/datasets.yml). Use -e dataset=<names, comma-separated>, or your own"
            " file with -e dataset_file=<path on the controller> -e dataset_format="
            f"{'|'.join(formats)}."
        )
    user_file, user_format = asked["dataset_file"], asked["dataset_format"]
    if user_file and user_format not in formats:
        raise Refused(
            f"dataset_format must be one of {', '.join(formats)} (got {json.dumps(user_format)}):"
            " see datasets_formats in group_vars/all/datasets.yml."
        )
    if not names and not user_file:
        names = [n.strip() for n in str(default).split(",") if n.strip()]
    datasets = [{**catalogue[n], "name": n} for n in names]
    if user_file:
        datasets.append({**formats[user_format], "name": "user_data", "file": user_file})
    return datasets


def hub_answer(url: str, headers: Mapping[str, str], timeout: float, ca_path: str) -> dict:
    """The hub's answer to one GET, shaped as ansible.builtin.uri registers it (status, msg,
    content, and the headers as lower-case keys with '_' for '-'); status -1 when none came."""

    def shaped(status: int, headers: Any, body: bytes) -> dict[str, Any]:  # noqa: ANN401
        answer = {k.lower().replace("-", "_"): v for k, v in (headers or {}).items()}
        return {**answer, "status": status, "content": body.decode("utf-8", "replace")}

    try:
        response = open_url(
            url,
            headers=dict(headers),
            timeout=timeout,
            ca_path=ca_path or None,
            follow_redirects="safe",
        )
        with response:
            return shaped(response.status, response.headers, response.read(MAX_ANSWER_BYTES))
    except HTTPError as err:
        return {**shaped(err.code, err.headers, err.read(MAX_ANSWER_BYTES)), "msg": str(err)}
    except (OSError, ValueError, UrlConnectionError) as err:  # unreachable, TLS, a malformed URL
        return {"status": -1, "msg": f"Request failed: {err}"}


def parse_config(text: str, request: Mapping[str, Any]) -> dict[str, Any]:
    """A model's config.json, parsed; raises Refused naming the file when it is not a model's."""
    where = f"Model {request['name']}: {request['source']}/config.json is"
    try:
        config = json.loads(text)
    except ValueError:
        raise Refused(
            f"{where} not valid JSON. Check the model directory (python3 -m json.tool shows "
            "where it breaks)."
        ) from None
    if not isinstance(config, dict):
        raise Refused(f"{where} not a JSON object, so not a model configuration.")
    return config


class ActionModule(ActionBase):
    """Check a new run's request and plan it (see plugins/modules/run_plan.py)."""

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict:
        """Check, plan, and return the plan; failed with the reason otherwise."""
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        _, asked = self.validate_argument_spec(option_spec())
        self._vars = task_vars
        self._changed = False
        try:
            plan, notes = self._plan(asked)
        except MasterRead as read:
            return {**result, "changed": self._changed, "read_on_master": read.path}
        except Refused as err:
            return {**result, "failed": True, "changed": self._changed, "msg": str(err)}
        except AnsibleError as err:  # the planner's PlanError, the inventory's filter errors
            message = err.args[0] if err.args else str(err)
            return {**result, "failed": True, "changed": self._changed, "msg": message}
        return {**result, "changed": self._changed, "plan": plan, "notes": notes}

    def _var(self, name: str, default: Any = None) -> Any:  # noqa: ANN401 - any variable
        """A variable of the play, templated (default when the play has none)."""
        if name not in self._vars:
            if default is None:
                raise Refused(f"llama.cluster.run_plan needs the variable {name} (group_vars/all).")
            return default
        return self._templar.template(self._vars[name])

    def _plan(self, asked: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The plan and the lines to show; raises Refused or the planner's error."""
        settings = {key: self._var(name) for key, name in TRAINING_SETTINGS.items()}
        settings["stages"] = list(DEEPSPEED_STAGES)
        settings["shared_storage"] = bool(self._var("training_shared_storage", False))
        entry, problems = find_model(settings["catalogue"], asked["model"], asked["model_path"])
        request = check_request(self._request(asked), DEEPSPEED_STAGES, problems)
        hostvars, groups = self._vars["hostvars"], self._var("groups")
        ranks = cluster_ranks(groups, hostvars)
        cluster_accelerator(list(ranks), hostvars)
        notes: list[str] = []
        staging = None
        self._token_note = ""
        if asked["probe_model"]:
            staging, config = self._model(asked, entry)
            request.update(model_path=staging["path"], model_config=config)
            notes.append(f"Model {staging['name']}: {staging['summary']}")
            if self._token_note:
                notes.append(self._token_note)
        datasets, records = self._datasets(asked, notes)
        request["dataset_records"] = records
        nprocs = {host: node_nproc(hostvars[host]) for host in ranks}
        plan = assemble(
            request,
            model=resolve_model(request, entry),
            nodes=describe_nodes(ranks, hostvars, nprocs),
            ranks=ranks,
            datasets=datasets,
            settings=settings,
        )
        if staging is not None:
            plan["model_stage"] = staging
        if asked["claim_run_id"] and not plan["resume"] and not self._task.check_mode:
            self._claim(plan, request)
        return plan, notes + plan["summary"]

    def _claim(self, plan: dict[str, Any], request: Mapping[str, Any]) -> None:
        """The run's id made unique on this controller, in the plan and in its summary."""
        planned = plan["run_id"]
        runs = Path(self._var("controller_runs_dir"))
        plan["run_id"] = claim_run_id(runs, request["timestamp"], request["model"])
        plan["summary"] = [line.replace(planned, plan["run_id"]) for line in plan["summary"]]
        self._changed = True

    def _request(self, asked: Mapping[str, Any]) -> dict[str, Any]:
        """What the user asked for, as check_request and resolve_model read it."""
        request = {
            key: asked[key]
            for key in (
                "model",
                "model_path",
                "model_template",
                "finetuning_type",
                "lora_target",
                "cutoff_len",
                "model_params_b",
                "trust_remote_code",
                "train_args",
                "max_restarts",
                "allow_slow_scaling",
                "fp8",
                "quantization_bit",
            )
        }
        request["deepspeed"] = asked["deepspeed"] or self._var("training_deepspeed")
        request["numerics"] = asked["numerics"] or self._var("training_numerics", "measured")
        tokens = asked["tokens_per_step"]
        request["tokens_per_step"] = (
            self._var("training_tokens_per_step") if tokens in (None, "") else tokens
        )
        request["timestamp"] = datetime.now(UTC).strftime(RUN_STAMP)
        return request

    # ---- the model ---------------------------------------------------------------------------
    def _model(
        self, asked: Mapping[str, Any], entry: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The staging request (no secrets in it) and the model's parsed config.json."""
        overrides = {"path": asked["model_path"], "revision": asked["model_revision"]}
        entry = {**entry, **{k: v for k, v in overrides.items() if v}}
        if asked["model_shared"]:
            entry["shared"] = True
        hub_dir = self._var("hub_cache_dir")
        request = model_stage_source(
            entry,
            asked["model"] or asked["model_path"],
            {
                "hub": self._var("model_hub"),
                "hub_dir": hub_dir,
                "models_dir": self._var("cluster_models_dir"),
                "generated_dir": self._var("tiny_model_dir"),
                "endpoints": {
                    "huggingface": self._var("hf_endpoint"),
                    "modelscope": self._var("modelscope_endpoint"),
                },
            },
        )
        if request["error"]:
            raise Refused(request["error"])
        if request["generated"]:
            self._generate(request["source"])
        if request["kind"] == "hub":
            request = self._ask_hub(request, hub_dir)
            config = request["config"]
        elif request["kind"] == "controller":
            config = self._controller_config(request)
        else:
            config = self._shared_config(request, asked["shared_config"], asked["ask_master"])
        staging = {k: v for k, v in request.items() if k not in ("config", "error")}
        return staging, config

    def _generate(self, directory: str) -> None:
        """Make the generated model on the controller with scripts/make_tiny_model.py, once."""
        script = Path(self._var("project_dir")) / TINY_MODEL_SCRIPT
        argv = [str(self._var("tiny_model_python")), str(script), directory]
        argv += [f"{flag}={self._var(name)}" for name, flag in TINY_MODEL_FLAGS.items()]
        made = self._execute_module(
            module_name="ansible.builtin.command",
            module_args={"argv": argv, "creates": f"{directory}/tiny_model.json"},
            task_vars=self._vars,
        )
        if made.get("failed"):
            output = (made.get("stderr") or made.get("msg") or "").strip().splitlines()
            raise Refused(
                f"The tiny model could not be generated in {directory} on the controller: "
                f"{output[-1] if output else 'no output'}"
            )
        self._changed |= bool(made.get("changed"))

    def _controller_config(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """config.json of a directory of the controller, which rsync copies to the nodes."""
        path = Path(request["source"]) / "config.json"
        if not path.is_file():
            raise Refused(
                f"Model {request['name']}: {request['source']} is not a model directory on the "
                "controller (it has no config.json). A directory that is already at the same "
                "path on every node (shared storage, or copied by you): add -e model_shared=true."
            )
        if shutil.which("rsync") is None:
            raise Refused(
                f"Model {request['name']} is copied from the controller to the nodes with rsync, "
                "which the controller lacks: apt-get install rsync (scripts/bootstrap-host.sh "
                "does); or put the model at the same path on every node and add "
                "-e model_shared=true."
            )
        return parse_config(path.read_text(errors="replace"), request)

    def _shared_config(
        self, request: Mapping[str, Any], slurped: str, ask_master: bool
    ) -> dict[str, Any]:
        """config.json of a directory on shared storage: the controller's copy, else the one
        read on the master (asked for with MasterRead where none was given)."""
        path = Path(request["source"]) / "config.json"
        if path.is_file():
            return parse_config(path.read_text(errors="replace"), request)
        if not slurped and ask_master:
            raise MasterRead(str(path))
        if not slurped:
            master = (self._var("groups").get("master") or ["the master"])[0]
            raise Refused(
                f"Model {request['name']}: {request['source']}/config.json is neither on the "
                f"controller nor on the master ({master}): model_shared means that the "
                "directory is at that path on every node."
            )
        return parse_config(base64.b64decode(slurped).decode("utf-8", "replace"), request)

    def _ask_hub(self, request: Mapping[str, Any], hub_dir: str) -> dict[str, Any]:
        """The request pinned to the hub's commit, with config.json: one GET at the endpoint,
        with the token where it may go (never in the result or a log)."""
        hub = request["hub"]
        token = str(self._var(TOKEN_VARIABLE[hub], "") or "")
        policy = model_stage_token_policy(
            hub, request["endpoint"], bool(token), self._var("hf_token_to_endpoint", False)
        )
        if not policy["send"]:
            token = ""
        headers = (
            {"Authorization": f"Bearer {token}", "Cookie": f"m_session_id={token}"} if token else {}
        )
        answer = hub_answer(
            request["probe_url"],
            headers,
            float(self._var("hub_probe_timeout")),
            str(self._var("hub_ca_bundle", "") or ""),
        )
        pinned = model_stage_probe(request, answer, bool(token), hub_dir, policy["note"])
        note = policy["note"]
        if pinned["error"]:
            raise Refused(
                pinned["error"] + (f" ({note})" if note and note not in pinned["error"] else "")
            )
        if note:
            self._token_note = note
        return pinned

    # ---- the datasets ------------------------------------------------------------------------
    def _datasets(
        self, asked: Mapping[str, Any], notes: list[str]
    ) -> tuple[list[dict[str, Any]], int]:
        """The run's datasets, each checked record by record on the controller, with the file to
        train on; and the count of valid records. Adds to notes what LLaMA-Factory will not read."""
        datasets = dataset_list(
            asked,
            self._var("datasets_catalogue"),
            self._var("datasets_formats"),
            self._var("datasets_default"),
        )
        skip = asked["dataset_skip_invalid"]
        skip = self._var("dataset_skip_invalid") if skip in (None, "") else skip
        project, runs = self._var("project_dir"), self._var("controller_runs_dir")
        checked, records = {}, 0
        for entry in datasets:
            path = entry["file"] if entry["file"].startswith("/") else f"{project}/{entry['file']}"
            args = {
                "name": entry["name"],
                "path": path,
                "formatting": entry.get("formatting", "alpaca"),
                "ranking": entry.get("ranking", False),
                "skip_invalid": skip,
                "valid_out": f"{runs}/datasets/{entry['name']}-"
                f"{hashlib.sha1(path.encode(), usedforsecurity=False).hexdigest()[:10]}"
                ".valid.jsonl",
            }
            args.update({k: entry[k] for k in ("columns", "tags") if k in entry})
            check = self._execute_module(
                module_name="llama.cluster.llama_dataset_check",
                module_args=args,
                task_vars=self._vars,
            )
            if check.get("failed"):
                raise Refused(check.get("msg") or f"Dataset {entry['name']}: the check failed.")
            self._changed |= bool(check.get("changed"))
            if check["invalid"]:
                notes.append(check["msg"])
                checked[entry["name"]] = check
            notes.extend(check.get("warnings_text") or [])
            records += int(check["valid"])
        return dataset_files(datasets, checked), records
