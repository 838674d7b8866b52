"""After training, on the 2-node molecule lab: TensorBoard, serving, export, and stopping.

One tiny run (report_to tensorboard, TensorBoard started by train.yml -e tensorboard=true) feeds
every test: its event files come back with the loss; headless Chromium renders its loss chart from
TensorBoard on the master; its LoRA adapter is served over LLaMA-Factory's OpenAI-compatible API
(with an API key, the one secret a lab can exercise end to end) and answers the controller and a
cluster node but not a container of the lab network outside the cluster; its adapter is merged
with export.yml and the merged model served; and stopping leaves nothing running. Each test
drives the playbooks as a user would; the nodes are inspected with `docker exec`.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from scenario import NODES, PREFIX, ROOT, RUNS, _address, _inventory

NETWORK = f"{PREFIX}-train"
OUTSIDER = f"{PREFIX}-train-outsider"
IMAGE = "llama-cluster-node:bookworm-2"
SERVE_PORT, TENSORBOARD_PORT = 8000, 6006
API_KEY = "lab-key-7d2f1c0b9e"  # LLAMA_SERVE_API_KEY for the serving tests
TRAIN_PYTHON = os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "")

_state: dict[str, object] = {}


def _playbook(playbook: str, *extra: str, api_key: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"}
    env["LLAMA_SERVE_API_KEY"] = api_key
    started = time.monotonic()
    done = subprocess.run(
        ["ansible-playbook", "-i", _inventory(), playbook, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        check=False,
        timeout=1200,
    )
    print(f"{playbook} {' '.join(extra)}: {time.monotonic() - started:.0f} s")
    return done


def _said(output: str) -> str:
    """The play's output with the YAML callback's line wrapping and quote doubling undone."""
    return " ".join(output.split()).replace("''", "'")


def _node(node: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "exec", node, "sh", "-c", command], capture_output=True, text=True, check=False
    )


# The same request from anywhere: python3 on the node image, urllib on the controller. The
# server's model name is the one GET /v1/models lists (LLaMA-Factory's API_MODEL_NAME; a chat
# completion only echoes the name the request gave).
ASK = r"""
import json, sys, urllib.request, urllib.error
url, key = sys.argv[1], sys.argv[2]
body = {"model": "any", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
headers = {"Content-Type": "application/json"}
if key:
    headers["Authorization"] = "Bearer " + key
request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
listing = urllib.request.Request(url + "/v1/models", headers=headers)
try:
    with urllib.request.urlopen(request, timeout=float(sys.argv[3])) as answer:
        data = json.load(answer)
    with urllib.request.urlopen(listing, timeout=float(sys.argv[3])) as models:
        names = [m["id"] for m in json.load(models)["data"]]
    choice = data["choices"][0]
    print(json.dumps({"status": answer.status, "model": names[0],
                      "role": choice["message"]["role"], "finish": choice["finish_reason"],
                      "tokens": data["usage"]["completion_tokens"]}))
except urllib.error.HTTPError as err:
    print(json.dumps({"status": err.code}))
except OSError as err:
    print(json.dumps({"status": None, "error": type(err).__name__ + ": " + str(err)}))
"""


def _ask(where: str, key: str = API_KEY, timeout: float = 60) -> dict:
    """POST one chat completion to the server on the master, from a container or the controller."""
    url = f"http://{_address(NODES[0])}:{SERVE_PORT}"
    if where == "controller":
        argv = ["python3", "-c", ASK, url, key, str(timeout)]
    else:
        argv = ["docker", "exec", where, "python3", "-c", ASK, url, key, str(timeout)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _services_running() -> str:
    out = _node(NODES[0], "ps -eo pid=,user=,args= | grep -E 'llamafactory-cli api|tensorboard' ")
    return "\n".join(line for line in out.stdout.splitlines() if "grep" not in line)


@pytest.fixture(scope="module", autouse=True)
def _stop_everything_after() -> Iterator[None]:
    """Whatever a test left, the next scenario's tests find no service running."""
    yield
    subprocess.run(["docker", "rm", "-f", OUTSIDER], capture_output=True, check=False)
    if os.environ.get("MOLECULE_INVENTORY_FILE") and _services_running():
        _playbook("playbooks/serve.yml", "-e", "serve_state=absent")
        _playbook("playbooks/tensorboard.yml", "-e", "tensorboard_state=absent")


def test_a_run_reporting_to_tensorboard_brings_its_loss_events_back(tiny_run: dict) -> None:
    if not TRAIN_PYTHON:
        pytest.skip("LLAMA_CLUSTER_TRAIN_PYTHON (tensorboard's event reader) is not set")
    done = tiny_run["done"]  # train.yml -e model=tiny -e tensorboard=true (conftest.py)
    assert done.returncode == 0, done.stdout[-5000:]
    said = _said(done.stdout)
    run_id = re.search(r"Run (train-\d{8}-\d{6}-[\w-]+) finished", said).group(1)
    _state["run_id"] = run_id
    assert f"TensorBoard of {run_id}: http://" in said
    local = ROOT / "runs" / run_id
    assert "report_to: tensorboard" in (local / "train.yaml").read_text()
    events = sorted((local / "tensorboard").glob("*/events.out.tfevents.*"))
    assert events, f"no event files under {local / 'tensorboard'}"
    read = subprocess.run(
        [
            TRAIN_PYTHON,
            "-c",
            "import json, sys\n"
            "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
            "ea = EventAccumulator(sys.argv[1]); ea.Reload()\n"
            "print(json.dumps([[e.step, e.value] for e in ea.Scalars('train/loss')]))",
            str(events[0].parent),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    scalars = json.loads(read.stdout.strip().splitlines()[-1])
    logged = [
        (r["current_steps"], r["loss"])
        for r in map(json.loads, (local / "trainer_log.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert [step for step, _ in scalars] == [step for step, _ in logged]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(scalars, logged, strict=True))
    _state["last_loss"] = logged[-1]


def test_tensorboard_on_the_master_renders_the_runs_loss_chart() -> None:
    if "last_loss" not in _state:
        pytest.skip("the tracked run did not complete")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's)")
    profile = ROOT / ".cache" / "chromium-profile"
    shutil.rmtree(profile, ignore_errors=True)
    started = time.monotonic()
    page = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1600,4000",  # tall enough for every scalar card to render
            "--virtual-time-budget=20000",
            "--dump-dom",
            f"http://{_address(NODES[0])}:{TENSORBOARD_PORT}/#timeseries",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    shutil.rmtree(profile, ignore_errors=True)
    text = re.sub(r"<(style|script)\b.*?</\1>", " ", page.stdout, flags=re.DOTALL)
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", text)).split())
    print(f"chromium: {time.monotonic() - started:.0f} s, {len(page.stdout)} bytes of DOM")
    card = text.find("train /loss")
    assert card >= 0, f"no loss chart on the page: {text[:2000]}"
    # The card's table: run, smoothed value, value and step of the last point.
    step, loss = _state["last_loss"]
    table = text[card : card + 600]
    assert f"{loss:.4f}".rstrip("0").rstrip(".") in table, table  # TensorBoard shows 4 decimals
    assert re.search(rf"\b{step}\b", table), table


def test_the_runs_adapter_is_served_to_the_cluster_and_refused_to_an_outsider() -> None:
    run_id = _state.get("run_id")
    if not run_id:
        pytest.skip("the tracked run did not complete")
    done = _playbook("playbooks/serve.yml", "-e", f"run_id={run_id}", api_key=API_KEY)
    assert done.returncode == 0, done.stdout[-5000:]
    said = _said(done.stdout)
    assert f"Serving run {run_id}'s LoRA adapter" in said
    assert f"URL: http://{_address(NODES[0])}:{SERVE_PORT}/v1" in said
    # The tiny model's sampled answer may be its end-of-text token alone: an empty text.
    assert "Answer:" in said, said[-2000:]
    assert API_KEY not in done.stdout
    # From the controller, as a client would (the play did the same), and with the wrong key.
    answer = _ask("controller")
    assert (answer["status"], answer["model"]) == (200, run_id), answer
    # A generated answer (its tokens counted, the end token included), whatever its text.
    assert answer["role"] == "assistant", answer
    assert answer["tokens"] >= 1, answer
    assert answer["finish"] in {"stop", "length"}, answer
    # The key is required: no key and a wrong one are refused alike.
    assert _ask("controller", key="")["status"] == 401
    assert _ask("controller", key="wrong")["status"] == 401
    # It listens on the master's cluster address only, not on every interface (127.0.0.1).
    loopback = subprocess.run(
        ["docker", "exec", NODES[0], "python3", "-c", ASK, f"http://127.0.0.1:{SERVE_PORT}",
         API_KEY, "8"],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    assert json.loads(loopback.stdout.strip().splitlines()[-1])["status"] is None, loopback
    # A cluster node is a configured source; a container of the same network is not.
    assert _ask(NODES[1])["status"] == 200
    subprocess.run(
        ["docker", "run", "-d", "--rm", "--name", OUTSIDER, "--network", NETWORK,
         "--entrypoint", "sleep", IMAGE, "600"],
        capture_output=True,
        text=True,
        check=True,
    )  # fmt: skip
    refused = _ask(OUTSIDER, timeout=8)
    subprocess.run(["docker", "rm", "-f", OUTSIDER], capture_output=True, check=False)
    assert refused["status"] is None, f"the outsider got an answer: {refused}"
    assert "timed out" in refused["error"], refused
    # The key lives only in a 0600 file of the job's user, outside the service's directory.
    secret = _node(NODES[0], "stat -c '%a %U' /opt/llama-cluster/secrets/serve-8000.env")
    assert secret.stdout.split() == ["600", "llama"], secret
    leaked = _node(
        NODES[0], f"grep -rl {API_KEY} /opt/llama-cluster/services /opt/llama-cluster/runs"
    )
    assert leaked.stdout == "", f"the key is written in {leaked.stdout}"
    again = _playbook("playbooks/serve.yml", "-e", f"run_id={run_id}", api_key=API_KEY)
    assert again.returncode == 0, again.stdout[-4000:]
    assert re.search(rf"{NODES[0]}\s*: ok=\d+\s+changed=0\b", again.stdout), (
        "a second serve.yml changed something"
    )
    _state["served"] = True


def test_the_merged_export_is_brought_back_and_served() -> None:
    run_id = _state.get("run_id")
    if not run_id:
        pytest.skip("the tracked run did not complete")
    export = _playbook("playbooks/export.yml", "-e", f"run_id={run_id}", "-e", "export_fetch=true")
    assert export.returncode == 0, export.stdout[-4000:]
    assert f"-e run_id={run_id} -e merged=true" in _said(export.stdout)
    again = _playbook("playbooks/export.yml", "-e", f"run_id={run_id}")
    assert again.returncode == 0, again.stdout[-4000:]
    assert "changed=0" in again.stdout, "a second export changed something"
    local = ROOT / "runs" / run_id / "merged"
    assert (local / "model.safetensors").stat().st_size > 0
    assert (local / "tokenizer.json").is_file()
    assert json.loads((local / "config.json").read_text())["model_type"] == "qwen2"
    done = _playbook(
        "playbooks/serve.yml", "-e", f"run_id={run_id}", "-e", "merged=true", api_key=API_KEY
    )
    assert done.returncode == 0, done.stdout[-5000:]
    assert f"Serving run {run_id}'s merged model" in _said(done.stdout)
    config = _node(NODES[0], "cat /opt/llama-cluster/services/serve-8000/api.yaml").stdout
    assert f'model_name_or_path: "{RUNS}/{run_id}/merged"' in config
    assert "adapter_name_or_path" not in config
    answer = _ask("controller")
    assert (answer["status"], answer["model"]) == (200, f"{run_id}-merged"), answer


def test_stopping_leaves_nothing_running_and_closes_the_ports() -> None:
    if not _state.get("served"):
        pytest.skip("nothing was served")
    for playbook, extra in (
        ("playbooks/serve.yml", "serve_state=absent"),
        ("playbooks/tensorboard.yml", "tensorboard_state=absent"),
    ):
        done = _playbook(playbook, "-e", extra)
        assert done.returncode == 0, done.stdout[-4000:]
        assert "Stopped" in _said(done.stdout)
    assert _services_running() == ""
    active = json.loads(_node(NODES[0], "/usr/local/sbin/llama-job list --active").stdout)
    assert active == {"jobs": []}
    rules = _node(NODES[0], "ufw status").stdout
    assert f"{SERVE_PORT}/tcp" not in rules
    assert f"{TENSORBOARD_PORT}/tcp" not in rules
    # The hub token of the shared tiny run (conftest.py) stays until a run without one.
    left = set(_node(NODES[0], "ls /opt/llama-cluster/secrets").stdout.split()) - {"hf_token"}
    assert left == set(), f"secrets left: {left}"
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(f"http://{_address(NODES[0])}:{SERVE_PORT}/v1/models", timeout=5)
