"""What a caller passes to the Python API and the CLI is data, never a template (issue 40).

ansible-playbook evaluates Jinja in its extra variables: `Cluster.train(model="tiny{{
lookup('pipe', ...) }}")` ran a command on the controller. The proof here is a real
ansible-runner run whose values hold a pipe lookup that would create a marker file, in every
place a value can be (a public value, a key, a list item, a secret), then train.yml through the
API and the CLI with the issue's two probes: the marker is never created, the playbook receives
the text as it was written, and the request is refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from llama_runner import Cluster, InvalidInput
from llama_runner.api import PROJECT_DIR
from llama_runner.errors import EXIT_INVALID_INPUT
from llama_runner.extravars import UNSAFE_TAG, argument, unsafe_yaml


def _pipe(marker: Path) -> str:
    """A template that, evaluated, creates `marker` on the controller."""
    return "{{ lookup('pipe', 'touch " + str(marker) + "') }}"


# --------------------------------------------------------------------------------------------
# The YAML that carries them
# --------------------------------------------------------------------------------------------
def test_every_string_is_tagged_unsafe_and_the_line_reads_back_the_same():
    variables = {
        "model": "tiny{{ x }}",
        "train_args": {"k{% if 1 %}": ["a\nb", 3, True, None, 1.5], "empty": {}},
        "odd": "quote \" and ' and \u2028 and é",
    }
    line = unsafe_yaml(variables, one_line=True)
    assert "\n" not in line
    assert line.count(UNSAFE_TAG) == 8  # three names, two keys, three strings
    # SafeLoader rejects an unknown tag; read the tag as a plain string to compare the data.
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor(UNSAFE_TAG, lambda load, node: load.construct_scalar(node))
    assert yaml.load(line, Loader=loader) == variables
    assert yaml.load(unsafe_yaml(variables, one_line=False), Loader=loader) == variables
    assert argument({}) == ""


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({"bad-name": 1}, "extra variable names must be identifiers"),
        ({"x": Path("/tmp")}, "extra variable x is a PosixPath"),
        ({"x": {"y": {1.5: 2}}}, "extra variable x.y: key 1.5 must be a string"),
        ({"x": [float("nan")]}, "extra variable x[0] = nan: a number must be finite"),
    ],
)
def test_values_that_are_not_data_are_refused_naming_where(variables: dict, said: str):
    with pytest.raises(ValueError, match=said.replace("[", r"\[").replace(".", r"\.")):
        unsafe_yaml(variables, one_line=True)


# --------------------------------------------------------------------------------------------
# A real run
# --------------------------------------------------------------------------------------------
RECEIVE = """
- name: Receive the values
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Write what arrived
      ansible.builtin.copy:
        dest: "{{ received }}"
        content: >-
          {{ {'model': model, 'nested': nested, 'serve_api_key': serve_api_key} | to_json }}
        mode: "0600"
"""


def test_api_values_that_hold_templates_arrive_as_text_and_run_nothing(tmp_path: Path):
    marker = tmp_path / "marker"
    playbook = tmp_path / "receive.yml"
    playbook.write_text(RECEIVE)
    received = tmp_path / "received.json"
    cluster = Cluster(tmp_path / "none.yml", private_data_dir=tmp_path / "runner")
    sent = {
        "model": f"tiny{_pipe(marker)}",
        "nested": {f"key{_pipe(marker)}": [_pipe(marker), 1, {"deep": _pipe(marker)}]},
        "serve_api_key": f"secret{_pipe(marker)}",  # a secret: the 0600 file, not -e
    }
    result = cluster.run_playbook(playbook, {"received": str(received), **sent}, inventory=False)
    assert result.ok
    assert not marker.exists()
    assert json.loads(received.read_text()) == sent
    command = json.loads((result.artifact_dir / "command").read_text())["command"]
    assert any(arg.startswith(f'{{{UNSAFE_TAG} "') for arg in command), command


def test_api_refuses_a_value_that_is_not_data_before_any_run(tmp_path: Path):
    cluster = Cluster(tmp_path / "none.yml", private_data_dir=tmp_path / "runner")
    with pytest.raises(InvalidInput, match="extra variable names must be identifiers"):
        cluster.run_playbook(PROJECT_DIR / "train.yml", {"no good": 1}, inventory=False)
    assert not (tmp_path / "runner" / "artifacts").exists()


def test_api_train_with_a_template_in_the_model_runs_nothing_and_names_the_model(
    tmp_path: Path, test_net_inventory: Path
):
    marker = tmp_path / "marker"
    cluster = Cluster(test_net_inventory, private_data_dir=tmp_path / "runner")
    with pytest.raises(InvalidInput) as caught:
        cluster.train(f"tiny{_pipe(marker)}", controller_runs_dir=str(tmp_path / "runs"))
    assert not marker.exists()
    assert "lookup('pipe'" in caught.value.message  # the name as given, unevaluated
    assert "Unknown model" in caught.value.message
    assert not (tmp_path / "runs").exists()


def test_cli_train_with_a_template_in_the_dataset_runs_nothing_and_names_the_dataset(
    tmp_path: Path, test_net_inventory: Path
):
    # The probe: `train_runner.py train --dataset "{{ lookup('pipe', 'touch ...') }}"`
    # created the file and trained the default dataset. A model directory of the controller
    # (no hub, nothing generated) so that the request reaches the datasets' check.
    marker = tmp_path / "marker"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2})
    )
    shown = subprocess.run(
        [
            sys.executable, str(PROJECT_DIR / "train_runner.py"),
            "--private-data-dir", str(tmp_path / "runner"),
            "-i", str(test_net_inventory),
            "train", "--model", "mine", "--dataset", _pipe(marker),
            "-e", f"model_path={model}", "-e", "model_template=qwen",
            "-e", f"controller_runs_dir={tmp_path / 'runs'}",
        ],
        cwd=PROJECT_DIR, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    said = " ".join(shown.stdout.split())
    assert shown.returncode == EXIT_INVALID_INPUT, said[-3000:]
    assert not marker.exists()
    assert "Unknown dataset {{ lookup('pipe'" in said


# --------------------------------------------------------------------------------------------
# The command line's -e: no traceback for what a user types (issue 48)
# --------------------------------------------------------------------------------------------
def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from llama_runner.cli import main  # noqa: PLC0415 - rich, only for these tests

    code = main(argv)
    return code, " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["train", "-e", "dataset={{ x }}"],
            "-e dataset=...: the value '{{ x }}' is not YAML (found unhashable key at column 2; "
            "YAML reads a value that starts with { or [ as a mapping or a list); to pass it as "
            "text, quote it",
        ),
        (["train", "-e", "x=[1,"], "-e x=...: the value '[1,' is not YAML ("),
        (["train", "-e", '{"a": [}'], "is not a YAML or JSON mapping: expected the node content"),
        (["train", "--model", "a", "-e", "model=b"], "-e model='b' and --model 'a' disagree"),
        (["plan", "-e", "resume=1"], "-e resume=1: --resume takes true or false"),
        (["scaling", "-e", "steps=many"], "-e steps='many': --steps takes an integer"),
        (["train", "-e", "nodes=true"], "-e nodes=True: --nodes takes an integer"),
    ],
)
def test_cli_refuses_an_unreadable_or_contradicting_e_naming_the_value_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
):
    code, shown = _cli(["-i", str(tmp_path / "none.yml"), *argv], capsys)
    assert code == EXIT_INVALID_INPUT, shown
    assert said in shown
    assert "Traceback" not in shown


def test_cli_takes_an_e_that_names_a_flag_as_the_flag(tmp_path: Path, test_net_inventory: Path):
    # `train -e model=... -e run_id=...` crashed with "got multiple values"; now -e model is
    # --model (the refusal names the model asked for), and -e run_id that agrees with
    # --run-id is taken once.
    shown = subprocess.run(
        [
            sys.executable, str(PROJECT_DIR / "train_runner.py"),
            "--private-data-dir", str(tmp_path / "runner"), "-i", str(test_net_inventory),
            "train", "-e", "model=no-such-model", "-e", "detach=false",
            "-e", f"controller_runs_dir={tmp_path / 'runs'}",
        ],
        cwd=PROJECT_DIR, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    said = " ".join((shown.stdout + shown.stderr).split())
    assert shown.returncode == EXIT_INVALID_INPUT, said[-3000:]
    assert "Traceback" not in said
    assert 'Unknown model "no-such-model"' in said
