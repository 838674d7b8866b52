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
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.parse import urljoin, urlsplit

from ansible.errors import AnsibleError
from ansible.module_utils.urls import ConnectionError as UrlConnectionError
from ansible.module_utils.urls import open_url
from ansible.parsing.plugin_docs import read_docstring
from ansible.plugins.action import ActionBase
from ansible_collections.llama.cluster.plugins.module_utils.fewer_nodes import plan_fewer_nodes
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
    MAX_ANSWER_BYTES,
    TOKEN_VARIABLE,
    find_model,
    model_stage_answer,
    model_stage_headers,
    model_stage_probe,
    model_stage_reached,
    model_stage_source,
    model_stage_token_policy,
    model_stage_unpinned,
    resolve_model,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    cluster_accelerator,
    describe_nodes,
    usage_by_host,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Plan, Request
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

# A run planned in a second that another run of this controller holds takes a later one.
CLAIM_SECONDS = 60
# Redirects the hub probe follows, and the headers it never carries to another host.
MAX_REDIRECTS = 5
CREDENTIAL_HEADERS = ("authorization", "cookie")


class Refused(Exception):
    """A request that cannot be planned, with the message the user sees."""


class MasterRead(Exception):
    """The plan needs what only the master can read (O(ask_master)): a shared model's config.json
    (read_on_master), or the hub's answer (hub_on_master)."""

    def __init__(self, key: str, value: object) -> None:
        super().__init__(key)
        self.key, self.value = key, value


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


def origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port of a URL (the port a scheme implies where none is written)."""
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


def redirect_headers(headers: Mapping[str, str], here: str, there: str) -> dict[str, str]:
    """The headers to send on a redirect from `here` to `there`: all of them on the same host
    (scheme, name and port); none of the credentials (the hub's token, a cookie) elsewhere, a
    CDN's signed URL or a host that is not the hub's."""
    if origin(here) == origin(there):
        return dict(headers)
    return {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}


def hub_answer(url: str, headers: Mapping[str, str], timeout: float, ca_path: str) -> dict:
    """The hub's answer to one GET, shaped as ansible.builtin.uri registers it (status, msg,
    content, and the headers as lower-case keys with '_' for '-'); status -1 when none came.
    Redirects are followed here, up to MAX_REDIRECTS, with redirect_headers: the token never
    leaves the host it was meant for."""

    def shaped(status: int, headers: Any, body: bytes) -> dict[str, Any]:  # noqa: ANN401
        answer = {k.lower().replace("-", "_"): v for k, v in (headers or {}).items()}
        return {**answer, "status": status, "content": body.decode("utf-8", "replace")}

    here, sent = url, dict(headers)
    for _ in range(MAX_REDIRECTS + 1):
        try:
            with open_url(
                here,
                headers=sent,
                timeout=timeout,
                ca_path=ca_path or None,
                follow_redirects="none",
            ) as response:
                return shaped(response.status, response.headers, response.read(MAX_ANSWER_BYTES))
        except HTTPError as err:
            location = (err.headers or {}).get("Location") if 300 <= err.code < 400 else None
            if not location:
                answer = shaped(err.code, err.headers, err.read(MAX_ANSWER_BYTES))
                return {**answer, "msg": str(err)}
            there = urljoin(here, location)
            sent = redirect_headers(sent, here, there)
            here = there
        except (OSError, ValueError, UrlConnectionError) as err:  # unreachable, TLS, a bad URL
            return {"status": -1, "msg": f"Request failed: {err}"}
    return {"status": -1, "msg": f"Request failed: more than {MAX_REDIRECTS} redirects from {url}"}


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
            if asked["saved"]:
                return {**result, "changed": False, "plan": self._saved(asked)}
            plan, notes, checked = self._plan(asked)
        except MasterRead as read:
            return {**result, "changed": self._changed, read.key: read.value}
        except Refused as err:
            return {**result, "failed": True, "changed": self._changed, "msg": str(err)}
        except AnsibleError as err:  # the planner's PlanError, the inventory's filter errors
            message = err.args[0] if err.args else str(err)
            return {**result, "failed": True, "changed": self._changed, "msg": message}
        return {
            **result,
            "changed": self._changed,
            "plan": plan.to_dict(),
            "notes": notes,
            "checked": checked,
        }

    @staticmethod
    def _saved(asked: Mapping[str, Any]) -> dict[str, Any]:
        """A run's plan.json read back (of any version: Plan.from_dict), resumed where asked."""
        try:
            saved = Plan.from_dict(json.loads(asked["saved"]))
        except (ValueError, KeyError, TypeError) as err:
            raise Refused(f"The run's plan.json cannot be read as a plan: {err!r}.") from None
        if asked["resume"]:
            saved = saved.resumed(asked["max_restarts"])
        return saved.to_dict()

    def _var(self, name: str, default: Any = None) -> Any:  # noqa: ANN401 - any variable
        """A variable of the play, templated (default when the play has none)."""
        if name not in self._vars:
            if default is None:
                raise Refused(f"llama.cluster.run_plan needs the variable {name} (group_vars/all).")
            return default
        return self._templar.template(self._vars[name])

    def _plan(self, asked: dict[str, Any]) -> tuple[Plan, list[str], dict[str, Any]]:
        """The plan, the lines to show and what was checked (for O(replan)); raises Refused or
        the planner's error."""
        settings = {key: self._var(name) for key, name in TRAINING_SETTINGS.items()}
        settings["stages"] = list(DEEPSPEED_STAGES)
        settings["shared_storage"] = bool(self._var("training_shared_storage", False))
        settings["planning_profiles"] = self._var("training_planning_profiles", {})
        hostvars, groups = self._vars["hostvars"], self._var("groups")
        checked = (asked["replan"] or {}).get("checked")
        if not checked:
            checked = self._check(asked, settings, hostvars, groups)
        ranks = cluster_ranks(groups, hostvars)
        nprocs = {host: node_nproc(hostvars[host]) for host in ranks}
        nodes = describe_nodes(ranks, hostvars, nprocs, usage_by_host(asked["node_usage"]))
        request = Request.of(checked["request"])
        plan = assemble(
            request,
            model=checked["model"],
            nodes=nodes,
            ranks=ranks,
            datasets=checked["datasets"],
            settings=settings,
        )
        plan = replace(plan, model_stage=checked["staging"])
        plan = plan_fewer_nodes(
            plan,
            request,
            model=checked["model"],
            nodes=nodes,
            datasets=checked["datasets"],
            settings=settings,
            min_nodes=checked.get("min_nodes", 0),
        )
        if self._task.check_mode:
            # Nothing is claimed: the id is what a run started now would be called.
            plan = self._renamed(plan, "Plan only (--check, no run started)", plan.run_id)
        elif checked.get("run_id"):
            plan = self._renamed(plan, f"Run {checked['run_id']}", checked["run_id"])
        elif asked["claim_run_id"]:
            run_id = self._claim(checked["request"])
            plan = self._renamed(plan, f"Run {run_id}", run_id)
        return plan, checked["notes"] + list(plan.summary), {**checked, "run_id": plan.run_id}

    def _check(
        self,
        asked: dict[str, Any],
        settings: Mapping[str, Any],
        hostvars: Mapping[str, Any],
        groups: Mapping[str, list[str]],
    ) -> dict[str, Any]:
        """The request checked, with its model (found, and probed unless O(probe_model) is
        false), its datasets checked record by record, the staging request and the notes so
        far; raises Refused or the planner's error."""
        entry, problems = find_model(settings["catalogue"], asked["model"], asked["model_path"])
        request = check_request(self._request(asked), DEEPSPEED_STAGES, problems)
        cluster_accelerator(list(cluster_ranks(groups, hostvars)), hostvars)
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
        return {
            "request": request,
            "model": resolve_model(request, entry),
            "datasets": datasets,
            "staging": staging,
            "notes": notes,
            "run_id": "",
            # Kept with the request: planning again for what is free (replan) plans it again.
            "min_nodes": int(asked["min_nodes"] or 0),
        }

    def _claim(self, request: Mapping[str, Any]) -> str:
        """The run's id made unique on this controller (its directory made)."""
        runs = Path(self._var("controller_runs_dir"))
        self._changed = True
        return claim_run_id(runs, request["timestamp"], request["model"])

    @staticmethod
    def _renamed(plan: Plan, said: str, run_id: str) -> Plan:
        """The plan with its run's id, and its first line saying `said` instead of the id the
        planner made up."""
        planned = f"Run {plan.run_id}"
        summary = tuple(line.replace(planned, said, 1) for line in plan.summary)
        return replace(plan, run_id=run_id, summary=summary)

    def _request(self, asked: Mapping[str, Any]) -> dict[str, Any]:
        """What the user asked for, as check_request and resolve_model read it."""
        request = {
            key: asked[key]
            for key in (
                "model",
                "model_path",
                "run_id",
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
        # The config a catalogue entry carries describes its own path, not another one.
        own = asked["model_path"] in ("", entry.get("path"))
        carried = dict(entry.get("config") or {}) if own else {}
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
        if request["generated"] and self._task.check_mode:
            return self._not_generated(request)
        if request["generated"]:
            self._generate(request["source"])
        if request["kind"] == "hub":
            request = self._ask_hub(request, hub_dir, asked, carried)
            config = request["config"]
        elif request["kind"] == "controller":
            config = self._controller_config(request)
        else:
            config = self._shared_config(request, asked["shared_config"], asked["ask_master"])
        staging = {k: v for k, v in request.items() if k not in ("config", "error")}
        return staging, config

    def _not_generated(self, request: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
        """A generated model in check mode: its config.json where it was made before; else the
        config.json it will have, made in a temporary directory that is removed at once (the
        plan depends on its shape: the go/no-go does)."""
        path = Path(request["source"]) / "config.json"
        staging = {k: v for k, v in request.items() if k != "error"}
        if path.is_file():
            return staging, parse_config(path.read_text(errors="replace"), request)
        with tempfile.TemporaryDirectory(prefix="llama-plan-") as scratch:
            made = subprocess.run(
                self._tiny_argv(f"{scratch}/tiny"),
                capture_output=True,
                text=True,
                check=False,
            )
            if made.returncode != 0:
                self._tiny_failed(request["source"], (made.stderr or made.stdout).strip())
            config = parse_config(Path(scratch, "tiny", "config.json").read_text(), request)
        staging["summary"] = (
            f"{request['source']} (not made yet: a real run generates it on the controller with "
            f"{TINY_MODEL_SCRIPT}), copied to {request['path']} on every node that lacks it"
        )
        return staging, config

    def _tiny_argv(self, directory: str) -> list[str]:
        """The command line that makes the generated model in `directory`."""
        script = Path(self._var("project_dir")) / TINY_MODEL_SCRIPT
        argv = [str(self._var("tiny_model_python")), str(script), directory]
        return argv + [f"{flag}={self._var(name)}" for name, flag in TINY_MODEL_FLAGS.items()]

    @staticmethod
    def _tiny_failed(directory: str, output: str) -> None:
        """Refuse a generated model that its script could not make."""
        lines = output.splitlines()
        raise Refused(
            f"The tiny model could not be generated in {directory} on the controller: "
            f"{lines[-1] if lines else 'no output'}"
        )

    def _generate(self, directory: str) -> None:
        """Make the generated model on the controller with scripts/make_tiny_model.py, once."""
        made = self._execute_module(
            module_name="ansible.builtin.command",
            module_args={
                "argv": self._tiny_argv(directory),
                "creates": f"{directory}/tiny_model.json",
            },
            task_vars=self._vars,
        )
        if made.get("failed"):
            self._tiny_failed(directory, (made.get("stderr") or made.get("msg") or "").strip())
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
            raise MasterRead("read_on_master", str(path))
        if not slurped:
            raise Refused(
                f"Model {request['name']}: {request['source']}/config.json is neither on the "
                f"controller nor on the master ({self._master()}): model_shared means that the "
                "directory is at that path on every node."
            )
        return parse_config(base64.b64decode(slurped).decode("utf-8", "replace"), request)

    def _master(self) -> str:
        """The master's inventory name."""
        return (self._var("groups").get("master") or ["the master"])[0]

    def _ask_hub(
        self,
        request: Mapping[str, Any],
        hub_dir: str,
        asked: Mapping[str, Any],
        carried: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The request pinned to the hub's commit, with config.json: one GET at the endpoint, with
        the token where it may go (never in the result or a log). Where the controller gets no
        answer, the master's (asked for with MasterRead, given back as O(hub_answer)); where
        neither gets one, the request unpinned with `carried` (the catalogue's config) or the
        size given, else refused."""
        hub = request["hub"]
        token = str(self._var(TOKEN_VARIABLE[hub], "") or "")
        policy = model_stage_token_policy(
            hub, request["endpoint"], bool(token), self._var("hf_token_to_endpoint", False)
        )
        sent, note = bool(token) and policy["send"], policy["note"]
        answer, asker = model_stage_answer(asked["hub_answer"]), f"the master {self._master()}"
        if not answer:
            asker = "the controller"
            answer = hub_answer(
                request["probe_url"],
                model_stage_headers(token, policy["send"]),
                float(self._var("hub_probe_timeout")),
                str(self._var("hub_ca_bundle", "") or ""),
            )
            if not model_stage_reached(answer) and asked["ask_master"]:
                ask = {"url": request["probe_url"], "token_variable": TOKEN_VARIABLE[hub]}
                raise MasterRead("hub_on_master", {**ask, "send_token": sent})
        sized = asked["model_params_b"] not in ("", None)
        if not model_stage_reached(answer) and (carried or sized):
            self._token_note = note
            return model_stage_unpinned(request, carried, answer, asker)
        pinned = model_stage_probe(request, answer, sent, hub_dir, note, asker=asker)
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
                # A module that died says why only in its stderr's last line.
                died = (check.get("module_stderr") or "").strip().splitlines()[-1:]
                raise Refused(
                    f"Dataset {entry['name']}: the check failed: {died[0]}"
                    if died
                    else check.get("msg") or f"Dataset {entry['name']}: the check failed."
                )
            self._changed |= bool(check.get("changed"))
            if check["invalid"]:
                notes.append(check["msg"])
                checked[entry["name"]] = check
            notes.extend(check.get("warnings_text") or [])
            records += int(check["valid"])
        return dataset_files(datasets, checked), records
