"""Secrets through the Python API: never on a command line, never in ansible-runner's artifacts.

The decisions (which names are secret) are unit tests; the proof is a real ansible-runner run of
a small playbook on localhost with recognisable fake secrets, one passed as an extra variable and
one exported in the controller's environment as a user would: the playbook must receive both,
and neither may show in any process's command line while it runs, in the artifacts, in the
runner's directory or in runs/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from ansible_collections.llama.cluster.plugins.lookup.secret_env import secret_env

from llama_runner import Cluster, InvalidInput
from llama_runner.api import PROJECT_DIR
from llama_runner.cli import _parse_assignments
from llama_runner.errors import EXIT_INVALID_INPUT
from llama_runner.secrets import (
    ENV_VARIABLE,
    SecretsFile,
    holds_secret,
    is_secret_env,
    run_secrets,
    split_extravars,
)

FAKE_HF = "hf_FAKE_runner_env_5f3a9c1d7e"  # exported as HF_TOKEN
FAKE_KEY = "sk-FAKE-runner-extravar-8b2e6f0a4c"  # passed as serve_api_key=
FAKE_WANDB = "FAKE-wandb-in-a-dict-1c7d9e3b"  # passed inside tracking_secrets={...}


# --------------------------------------------------------------------------------------------
# Which values are secret
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["hf_token", "serve_api_key", "tracking_secrets", "modelscope_token", "db_password", "KEY"],
)
def test_names_made_of_a_secret_word_are_secret(name: str):
    assert holds_secret(name, "x")


@pytest.mark.parametrize(
    "name", ["model", "tokens_per_step", "run_id", "keyboard", "monkey", "cutoff_len"]
)
def test_ordinary_names_are_public(name: str):
    assert not holds_secret(name, "x")


def test_a_variable_with_a_secret_key_inside_is_secret_as_a_whole():
    assert holds_secret("train_args", {"learning_rate": 1e-4, "hub_token": "t"})
    assert holds_secret("trackers", [{"name": "wandb", "api_key": "k"}])
    assert not holds_secret("train_args", {"learning_rate": 1e-4, "max_tokens": 8})


def test_split_keeps_public_variables_for_the_command_line():
    public, secret = split_extravars({"model": "tiny", "hf_token": "t", "resume": False})
    assert public == {"model": "tiny", "resume": False}
    assert secret == {"hf_token": "t"}


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("WANDB_API_KEY", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("MLFLOW_TRACKING_PASSWORD", True),
        ("HF_TOKEN_PATH", False),  # where the secret is
        ("GOOGLE_CREDENTIALS_FILE", False),
        ("ANSIBLE_VAULT_PASSWORD_FILE", False),  # Ansible's own setting, a file name
        ("ANSIBLE_BECOME_PASSWORD", False),
        ("SSH_AUTH_SOCK", False),
        ("PATH", False),
    ],
)
def test_secret_environment_variables(name: str, secret: bool):
    assert is_secret_env(name) is secret


def test_the_secret_environment_travels_as_one_variable_and_leaves_the_environment():
    public, secret, leave_out = run_secrets(
        {"model": "tiny"}, {"HF_TOKEN": "t", "HOME": "/root", "WANDB_API_KEY": "", "X_KEY": "k"}
    )
    assert public == {"model": "tiny"}
    assert secret == {ENV_VARIABLE: {"HF_TOKEN": "t", "X_KEY": "k"}}  # empty values stay
    assert leave_out == ["HF_TOKEN", "X_KEY"]


def test_the_runners_own_variable_cannot_be_passed(tmp_path: Path):
    cluster = Cluster(tmp_path / "none.yml", private_data_dir=tmp_path / "runner")
    playbook = tmp_path / "p.yml"
    playbook.write_text("- hosts: localhost\n  gather_facts: false\n  tasks: []\n")
    with pytest.raises(InvalidInput, match=ENV_VARIABLE):
        cluster.run_playbook(playbook, {ENV_VARIABLE: {}}, inventory=False)


def test_secrets_file_is_private_named_on_the_command_line_and_discarded(tmp_path: Path):
    secrets = SecretsFile(tmp_path, "run-1", {"hf_token": "t"})
    assert secrets.path is not None
    assert secrets.path.stat().st_mode & 0o777 == 0o600
    assert secrets.path.parent.stat().st_mode & 0o777 == 0o700
    assert secrets.argument == f"-e @{secrets.path}"
    path = secrets.path
    secrets.discard()
    secrets.discard()
    assert not path.exists()
    assert secrets.argument == ""
    assert SecretsFile(tmp_path, "run-2", {}).path is None


def test_secret_env_lookup_prefers_the_runners_copy_then_the_environment():
    environ = {"HF_TOKEN": "from-env", "WANDB_API_KEY": "w"}
    assert secret_env(["HF_TOKEN"], {"HF_TOKEN": "passed"}, environ) == ["passed"]
    assert secret_env(["HF_TOKEN", "WANDB_API_KEY"], None, environ) == ["from-env", "w"]
    assert secret_env(["NOT_SET"], {}, environ) == [""]


# --------------------------------------------------------------------------------------------
# A real run through the Python API
# --------------------------------------------------------------------------------------------
PLAYBOOK = """
- name: Receive the secrets
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Write what arrived, for the test to compare
      ansible.builtin.copy:
        dest: "{{ received }}"
        content: "{{ hf_token }} {{ serve_api_key }} {{ tracking_secrets.WANDB_API_KEY }}"
        mode: "0600"
      no_log: true
    - name: Hold the run while the test reads every command line
      ansible.builtin.command: sleep 4
      changed_when: false
"""


def _command_lines() -> list[str]:
    lines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                lines.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                continue
    return lines


def _files_holding(root: Path, *needles: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        # runs/ may be written meanwhile (the lab's tests on another worker): a file that is
        # gone (renamed into place, rotated) held nothing of this test.
        try:
            text = path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else ""
        except FileNotFoundError:
            continue
        found += [f"{path}: {needle}" for needle in needles if needle in text]
    return found


def test_api_run_keeps_secrets_off_command_lines_and_out_of_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("HF_TOKEN", FAKE_HF)
    fakes = (FAKE_HF, FAKE_KEY, FAKE_WANDB)
    playbook = tmp_path / "secrets.yml"
    playbook.write_text(PLAYBOOK)
    received = tmp_path / "received"
    runner_dir = tmp_path / "runner"
    seen_while_running: list[str] = []
    secrets_files_while_running: list[str] = []

    def on_event(event: dict) -> None:
        data = event.get("event_data", {})
        if event.get("event") == "runner_on_start" and data.get("task", "").startswith("Hold"):
            # ansible-playbook and its workers run now: every process's command line.
            seen_while_running.extend(
                f"{fake} in {line[:120]}"
                for line in _command_lines()
                for fake in fakes
                if fake in line
            )
            secrets_files_while_running.extend(str(p) for p in (runner_dir / "secrets").glob("*"))

    cluster = Cluster(tmp_path / "none.yml", private_data_dir=runner_dir, on_event=on_event)
    result = cluster.run_playbook(
        playbook,
        {
            "received": str(received),
            "serve_api_key": FAKE_KEY,
            "tracking_secrets": {"WANDB_API_KEY": FAKE_WANDB},
        },
        inventory=False,
    )

    assert result.ok
    # The playbook got all three: hf_token from the environment through the project's default.
    assert received.read_text() == f"{FAKE_HF} {FAKE_KEY} {FAKE_WANDB}"
    assert seen_while_running == []
    # The secrets file was gone once ansible-playbook had read it, and is not left behind.
    assert secrets_files_while_running == []
    assert list((runner_dir / "secrets").iterdir()) == []
    # The artifacts (command, stdout, job_events) hold none; the command names the file.
    command = json.loads((result.artifact_dir / "command").read_text())["command"]
    secrets_arg = command[command.index("-e") + 1]
    assert secrets_arg.startswith(f"@{runner_dir / 'secrets'}/")
    assert any('"received"' in arg for arg in command)  # public variables stay there
    leaks = _files_holding(runner_dir, *fakes)
    runs = PROJECT_DIR / "runs"
    leaks += _files_holding(runs, *fakes) if runs.is_dir() else []
    assert leaks == []
    assert os.environ["HF_TOKEN"] == FAKE_HF  # the caller's environment is left alone


def test_api_train_keeps_the_hf_token_from_a_mirror_and_out_of_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test_net_inventory: Path
):
    # train.yml stops on the controller at the hub probe (nothing listens on port 9; the master,
    # asked in its turn, does not answer), after the defaults have read the token: TEST-NET
    # nodes prove no node was written to. A model outside the catalogue: a catalogue model
    # would be planned with the config its entry carries.
    monkeypatch.setenv("HF_TOKEN", FAKE_HF)
    monkeypatch.setenv("ANSIBLE_TIMEOUT", "5")  # a TEST-NET master that drops packets
    inventory = test_net_inventory
    runner_dir = tmp_path / "runner"
    cluster = Cluster(inventory, private_data_dir=runner_dir)
    with pytest.raises(InvalidInput) as caught:
        cluster.train(
            "mine",
            model_path="org/absent",
            model_template="qwen",
            hf_endpoint="http://127.0.0.1:9",
            serve_api_key=FAKE_KEY,
        )
    message = caught.value.message
    assert "the endpoint is unreachable from the controller" in message
    stdout = caught.value.result.stdout_path.read_text()
    assert "hf_token is set but not sent to http://127.0.0.1:9" in stdout
    assert "Train | Prepare every node" not in stdout
    assert _files_holding(runner_dir, FAKE_HF, FAKE_KEY) == []


# --------------------------------------------------------------------------------------------
# The command line (train_runner.py)
# --------------------------------------------------------------------------------------------
def _cli(*args: str, stdin: str = "", env: dict[str, str] | None = None) -> tuple[int, str, list]:
    """train_runner.py with these arguments: its exit code, its output, and every command line
    that held a fake secret while it ran (read from /proc every 50 ms)."""
    process = subprocess.Popen(
        [sys.executable, str(PROJECT_DIR / "train_runner.py"), *args],
        cwd=PROJECT_DIR, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env,
    )  # fmt: skip
    assert process.stdin is not None
    process.stdin.write(stdin)
    process.stdin.close()
    seen: list[str] = []
    while process.poll() is None:
        seen += [
            line[:120]
            for line in _command_lines()
            if any(fake in line for fake in (FAKE_HF, FAKE_KEY, FAKE_WANDB))
        ]
        time.sleep(0.05)
    assert process.stdout is not None
    return process.returncode, process.stdout.read(), seen


def test_cli_refuses_a_secret_in_its_own_argv_naming_the_ways_that_work(tmp_path: Path):
    code, out, _ = _cli(
        "--private-data-dir", str(tmp_path / "runner"), "run", "x.yml", "-e", "hf_token=abc"
    )
    said = " ".join(out.split())
    assert code == EXIT_INVALID_INPUT
    assert "-e hf_token=... would put a secret on this command's own command line" in said
    assert "--secret hf_token" in said
    assert "--secrets-file FILE" in said
    assert "HF_TOKEN" in said
    # A mapping with a secret key inside is refused as well.
    code, out, _ = _cli("run", "x.yml", "-e", "tracking_secrets={WANDB_API_KEY: k}")
    assert code == EXIT_INVALID_INPUT
    # So is one inside ansible-playbook's mapping form of -e.
    code, out, _ = _cli("run", "x.yml", "-e", '{"hf_token": "abc", "model": "tiny"}')
    assert code == EXIT_INVALID_INPUT
    assert "-e hf_token=... would put a secret" in " ".join(out.split())


def test_cli_reads_e_as_key_value_or_as_ansible_playbook_s_mapping() -> None:
    assert _parse_assignments(
        ["model=tiny", '{"train_args": {"num_train_epochs": 2}, "steps": 5}', "{deepspeed: none}"]
    ) == {"model": "tiny", "train_args": {"num_train_epochs": 2}, "steps": 5, "deepspeed": "none"}
    for bad, said in [
        ("{train_args: [1", "is not a YAML or JSON mapping"),
        ('{"1x": 2}', "expected a mapping of variable names"),
        ("model", "expected KEY=VALUE or a mapping"),
    ]:
        with pytest.raises(InvalidInput, match=said):
            _parse_assignments([bad])


def test_cli_takes_secrets_from_stdin_a_file_and_the_environment_never_from_argv(
    tmp_path: Path,
):
    playbook = tmp_path / "secrets.yml"
    playbook.write_text(PLAYBOOK)
    received = tmp_path / "received"
    runner_dir = tmp_path / "runner"
    secrets_file = tmp_path / "secrets.yml.private"
    secrets_file.write_text(f"tracking_secrets:\n  WANDB_API_KEY: {FAKE_WANDB}\n")
    secrets_file.chmod(0o600)
    inventory = tmp_path / "local.yml"
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        '      ansible_python_interpreter: "{{ ansible_playbook_python }}"\n'
    )
    env = dict(os.environ, HF_TOKEN=FAKE_HF)
    code, out, seen = _cli(
        "--private-data-dir", str(runner_dir), "--inventory", str(inventory),
        "run", str(playbook), "-e", f"received={received}",
        "--secret", "serve_api_key", "--secrets-file", str(secrets_file),
        stdin=f"{FAKE_KEY}\n", env=env,
    )  # fmt: skip
    assert code == 0, out
    assert received.read_text() == f"{FAKE_HF} {FAKE_KEY} {FAKE_WANDB}"
    assert seen == []
    assert _files_holding(runner_dir, FAKE_HF, FAKE_KEY, FAKE_WANDB) == []
    assert FAKE_HF not in out
    assert FAKE_KEY not in out
    assert FAKE_WANDB not in out
