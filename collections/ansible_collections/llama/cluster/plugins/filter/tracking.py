"""What train.yml's experiment trackers need: report_to, the trackers' settings and their keys
(secrets) for a run (`tracking_plan`), and -e report_to / -e tensorboard folded into train_args
(`tracking_train_args`). Unit tests: tests/unit/roles/test_serve.py."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.llama.cluster.plugins.filter.serve import ServeError, as_flag

# Per tracker: the module the nodes need, the key it needs (unless its mode keeps it local), and
# the modes that need no key.
TRACKERS: dict[str, dict[str, Any]] = {
    "tensorboard": {"module": "tensorboard", "extra": "tensorboard", "keys": ()},
    "wandb": {
        "module": "wandb",
        "extra": "wandb",
        "keys": ("WANDB_API_KEY",),
        "mode": ("WANDB_MODE", ("offline", "disabled", "dryrun")),
    },
    "mlflow": {
        "module": "mlflow",
        "extra": "mlflow-skinny",
        "keys": (),
        "optional": (
            "MLFLOW_TRACKING_TOKEN",
            "MLFLOW_TRACKING_USERNAME",
            "MLFLOW_TRACKING_PASSWORD",
        ),
    },
    "swanlab": {
        "module": "swanlab",
        "extra": "swanlab",
        "keys": ("SWANLAB_API_KEY",),
        "mode": ("SWANLAB_MODE", ("local", "offline", "disabled")),
    },
}
SECRET_NAME = re.compile(r"(KEY|TOKEN|PASSWORD|SECRET)$")


def tracking_plan(
    report_to: object,
    environment: Mapping[str, Any] | None = None,
    secrets_given: Sequence[str] = (),
    tensorboard: object = False,
) -> dict[str, Any]:
    """report_to for train.yaml, the trackers' settings, the keys they need, and their modules.

    `report_to` is a tracker, a comma-separated list or a list (none: no tracking);
    `tensorboard` (train.yml -e tensorboard=true) adds tensorboard. `environment` holds settings
    (WANDB_PROJECT, MLFLOW_TRACKING_URI, ...): they go to the run's env file, so a key there is
    refused. `secrets_given` names the keys that have a value (never the values: the play picks
    the kept ones, `secret_names`, in a task that prints nothing); a tracker that needs a key
    (wandb, swanlab online) fails without it.
    """
    if isinstance(report_to, str):
        names = [n.strip() for n in report_to.split(",") if n.strip()]
    elif isinstance(report_to, Sequence):
        names = [str(n).strip() for n in report_to]
    else:
        names = []
    names = [n for n in names if n != "none"]
    if as_flag(tensorboard) and "tensorboard" not in names:
        names.append("tensorboard")
    problems: list[str] = []
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        problems.append(
            f"report_to {', '.join(unknown)}: use {', '.join(TRACKERS)} (comma-separated for "
            "several) or none"
        )
    env = {str(k): str(v) for k, v in (environment or {}).items()}
    leaked = sorted(k for k in env if SECRET_NAME.search(k))
    if leaked:
        problems.append(
            f"tracking_environment holds {', '.join(leaked)}: keys go in tracking_secrets (a "
            "0600 file of the job's user), never in the run's env file"
        )
    given = {str(k) for k in secrets_given}
    kept: list[str] = []
    for name in names:
        tracker = TRACKERS.get(name)
        if tracker is None:
            continue
        mode_var, local_modes = tracker.get("mode", ("", ()))
        local = env.get(mode_var, "").lower() in local_modes
        for key in tracker["keys"]:
            if key in given:
                kept.append(key)
            elif not local:
                problems.append(
                    f"report_to={name} needs {key}: export it on the controller, or set "
                    f"tracking_secrets.{key} (ansible-vault), or log offline "
                    f"({mode_var}={local_modes[0]} in tracking_environment)"
                )
        kept += [key for key in tracker.get("optional", ()) if key in given]
    if problems:
        raise ServeError(
            "Experiment tracking:\n- " + "\n- ".join(problems) + "\nNothing was changed."
        )
    known = [n for n in names if n in TRACKERS]
    return {
        "trackers": known,
        "report_to": (known[0] if len(known) == 1 else known) if known else "none",
        "environment": env if known else {},
        "secret_names": sorted(set(kept)),
        "modules": {TRACKERS[n]["module"]: TRACKERS[n]["extra"] for n in known},
    }


def tracking_train_args(
    train_args: object, report_to: object = "", tensorboard: object = False
) -> object:
    """train_args with report_to as train.yml's -e report_to and -e tensorboard=true ask.

    -e report_to replaces train_args.report_to; -e tensorboard=true adds tensorboard to whatever
    report_to is then (TensorBoard shows the event files report_to tensorboard writes). Neither
    given: train_args as it is (training_defaults has report_to: none). train_args that is not a
    mapping comes back as it is, for the planner to refuse with its own message.
    """
    if train_args in (None, ""):
        train_args = {}
    if not isinstance(train_args, Mapping):
        return train_args
    args = dict(train_args)
    if report_to not in (None, ""):
        args["report_to"] = report_to
    if as_flag(tensorboard):
        current = args.get("report_to", "none")
        names = current if isinstance(current, list) else str(current).split(",")
        names = [str(n).strip() for n in names if str(n).strip() not in ("", "none")]
        if "tensorboard" not in names:
            names.append("tensorboard")
        args["report_to"] = names[0] if len(names) == 1 else names
    return args


class FilterModule:
    """Experiment tracking decisions."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {"tracking_plan": tracking_plan, "tracking_train_args": tracking_train_args}
