"""Secrets of a run: which values are secret, and how ansible-playbook gets them without a
command line or an artifact of ansible-runner holding them.

ansible-runner starts ansible-playbook with every extra variable as `-e <json>` (visible in the
process list to every user of the controller) and writes that command line, with the whole
environment it passes on, to `artifacts/<ident>/command`. So a run's secrets travel otherwise:

- secret extra variables (a name or a key inside it made of a word such as key, token,
  password or secret: `hf_token`, `serve_api_key`, `tracking_secrets`) go to a 0600 YAML file
  under `<private_data_dir>/secrets/` passed as `-e @<file>` (every string in it `!unsafe`, as
  llama_runner/extravars.py writes it: never a template), removed as soon as ansible-playbook
  has read its extra variables (its playbook_on_start event) and in any case after the run;
- secret variables of the controller's environment (`HF_TOKEN`, `WANDB_API_KEY`, ...) leave the
  environment that ansible-runner records and passes on, and travel in the same file as the
  variable `runner_secret_env`, which the project's defaults read through
  `lookup('llama.cluster.secret_env', NAME)` (the environment itself when ansible-playbook runs
  without the runner).
"""

from __future__ import annotations

import os
import re
import shlex
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llama_runner.extravars import unsafe_yaml

# Words of a name (split at anything not a letter or digit) that make it a secret. "tokens"
# is left out on purpose: a training project counts tokens everywhere (tokens_per_step).
SECRET_WORDS = frozenset(
    {"key", "keys", "token", "password", "passwd", "secret", "secrets", "credential", "credentials"}
)
# Last words of environment variables that name where a secret is, not the secret itself.
LOCATION_WORDS = frozenset({"file", "path", "dir", "url"})
# The extra variable that carries the controller's secret environment (read by the lookup
# llama.cluster.secret_env).
ENV_VARIABLE = "runner_secret_env"
SECRETS_DIR = "secrets"


def _words(name: str) -> list[str]:
    return [word for word in re.split(r"[^a-z0-9]+", name.lower()) if word]


def is_secret_name(name: str) -> bool:
    """Whether a variable's name says it holds a secret (hf_token, WANDB_API_KEY, ...)."""
    return any(word in SECRET_WORDS for word in _words(name))


def holds_secret(name: str, value: object) -> bool:
    """Whether an extra variable is secret: its name, or a key anywhere inside its value."""
    if is_secret_name(name):
        return True
    if isinstance(value, Mapping):
        return any(holds_secret(str(key), item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(holds_secret("", item) for item in value)
    return False


def split_extravars(extravars: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The extra variables that may go on the command line, and the secret ones."""
    public: dict[str, Any] = {}
    secret: dict[str, Any] = {}
    for name, value in extravars.items():
        (secret if holds_secret(name, value) else public)[name] = value
    return public, secret


def is_secret_env(name: str) -> bool:
    """Whether an environment variable of the controller holds a secret.

    Ansible's own settings (ANSIBLE_*: ansible-playbook reads them, and they hold file names
    such as ANSIBLE_VAULT_PASSWORD_FILE) and variables that say where a secret is
    (HF_TOKEN_PATH, ..._FILE) stay in the environment.
    """
    words = _words(name)
    if not words or words[0] == "ansible" or words[-1] in LOCATION_WORDS:
        return False
    return is_secret_name(name)


def secret_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The secret variables of an environment (non-empty ones)."""
    return {name: value for name, value in environ.items() if value and is_secret_env(name)}


class SecretsFile:
    """One run's secret extra variables, in a 0600 file only while ansible-playbook needs it.

    `argument` is what goes on the command line (`-e @<path>`), "" when there is nothing
    secret. discard() removes the file; it is safe to call more than once, from any thread.
    ValueError (before any file is made) for a value that cannot be passed (extravars.plain).
    """

    def __init__(self, private_data_dir: Path, ident: str, variables: Mapping[str, Any]) -> None:
        self.path: Path | None = None
        self._lock = threading.Lock()
        if not variables:
            return
        text = unsafe_yaml(variables, one_line=False)
        directory = private_data_dir / SECRETS_DIR
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        path = directory / f"{ident}.yml"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
        self.path = path

    @property
    def argument(self) -> str:
        """The `cmdline` of ansible-runner that names the file ("" without one)."""
        return f"-e @{shlex.quote(str(self.path))}" if self.path else ""

    def discard(self) -> None:
        """Remove the file (ansible-playbook has read it, or the run is over)."""
        with self._lock:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
                self.path = None


def run_secrets(
    extravars: Mapping[str, Any], environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Split a run's inputs: the public extra variables, the secret ones (the controller's
    secret environment under ENV_VARIABLE), and the environment variables to leave out."""
    public, secret = split_extravars(extravars)
    env_secrets = secret_environment(environ)
    if ENV_VARIABLE in extravars:
        raise ValueError(f"{ENV_VARIABLE} is the runner's own variable; do not pass it")
    if env_secrets:
        secret[ENV_VARIABLE] = env_secrets
    return public, secret, sorted(env_secrets)
