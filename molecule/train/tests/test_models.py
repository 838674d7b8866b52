"""The run's model on every node, on the 2-node molecule lab: the tiny model kept on the controller
is copied to both nodes and trains, a second staging sends nothing, a hub id is downloaded once
per node (atomically, with progress, with the token from its file), an unreachable hub fails
before any node changes, and a token never shows up where it should not.

No model hub is reachable here, so the hub tests serve the tiny model from a small HTTP server
on the controller that speaks the part of the Hugging Face Hub's API the real huggingface_hub
client on the nodes uses (the tree listing, HEAD and GET of /resolve/, X-Repo-Commit).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import HF_TOKEN as TOKEN

ROOT = Path(__file__).resolve().parents[3]
PREFIX = os.environ.get("LLAMA_MOLECULE_PREFIX", "mol")
NODES = (f"{PREFIX}-train-node1", f"{PREFIX}-train-node2")
BASE = "/opt/llama-cluster"
CACHE = Path(os.environ.get("LLAMA_CLUSTER_CACHE") or Path.home() / ".cache" / "llama-cluster")
TINY = CACHE / "models" / "tiny"
HUB_REPO = "llama-cluster/tiny-hub"
COMMIT = "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678"
HUB_PATH = f"{BASE}/models/hub/huggingface/llama-cluster--tiny-hub/{COMMIT}"


def _inventory() -> str:
    path = os.environ.get("MOLECULE_INVENTORY_FILE")
    if not path:
        pytest.skip("runs under molecule verify (MOLECULE_INVENTORY_FILE is not set)")
    return path


def _playbook(playbook: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ansible-playbook", "-i", _inventory(), playbook, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"},
        check=False,
        timeout=1200,
    )


def _node(node: str, command: str) -> str:
    return subprocess.run(
        ["docker", "exec", node, "sh", "-c", command], capture_output=True, text=True, check=False
    ).stdout


def _said(output: str) -> str:
    return " ".join(output.split())


def _recap(output: str) -> dict[str, int]:
    """changed= per host from the PLAY RECAP."""
    return {h: int(n) for h, n in re.findall(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", output, re.M)}


def _task_results(output: str, task: str) -> list[str]:
    """The result lines (ok/changed/skipping/fatal: [host]) printed under one task."""
    lines, inside = [], False
    for line in output.splitlines():
        if line.startswith("TASK ["):
            inside = task in line
        elif inside and re.match(r"^(ok|changed|skipping|fatal): \[", line):
            lines.append(line.split(" =>")[0])
    return lines


def _sums(node: str, directory: str) -> dict[str, str]:
    out = _node(node, f"cd {directory} && sha256sum $(find . -maxdepth 1 -type f | sort)")
    return {name.removeprefix("./"): digest for digest, name in map(str.split, out.splitlines())}


def _local_sums(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _assert_no_token(where: str, text: str) -> None:
    assert TOKEN not in text, f"the token shows in {where}"


def _staged() -> None:
    """Skip unless the tiny model is on the nodes (the first test puts it there)."""
    if not _node(NODES[0], f"ls {BASE}/models/tiny/config.json 2>/dev/null"):
        pytest.skip("the tiny model is not on the nodes (the tiny run did not stage it)")


def test_the_controllers_tiny_model_is_staged_and_trains_keeping_the_token_secret(
    tiny_run: dict,
) -> None:
    done = tiny_run["done"]  # train.yml -v -e model=tiny -e hf_token=TOKEN (conftest.py)
    assert done.returncode == 0, done.stdout[-5000:]
    _assert_no_token("the play's output (-v)", done.stdout)
    said = _said(done.stdout)
    assert f"Model tiny: {TINY} (generated on the controller), copied to {BASE}/models/tiny" in said
    run_id = re.search(r"Run (train-\d{8}-\d{6}-tiny)", said).group(1)
    controller = _local_sums(TINY)
    for node in NODES:
        assert _sums(node, f"{BASE}/models/tiny") == controller, f"{node} has another copy"
        owners = _node(node, f"stat -c '%U:%G' {BASE}/models/tiny {BASE}/models/tiny/*").split()
        assert set(owners) == {"llama:llama"}
        run = f"{BASE}/runs/{run_id}"
        assert f"model_name_or_path: {BASE}/models/tiny\n" in _node(node, f"cat {run}/train.yaml")
        env = _node(node, f"cat {run}/env/{node}.env")
        assert 'HF_HUB_OFFLINE="1"' in env
        assert f'HF_TOKEN_PATH="{BASE}/secrets/hf_token"' in env
        assert "world size: 2" in _node(node, f"cat {run}/logs/{node}.log")
        # The token: a 0600 file of the job's user in a 0700 directory, and nowhere else.
        assert _node(
            node, f"stat -c '%U:%G %a' {BASE}/secrets {BASE}/secrets/hf_token"
        ).split() == ["llama:llama", "700", "llama:llama", "600"]
        assert _node(node, f"cat {BASE}/secrets/hf_token").strip() == TOKEN
        found = _node(
            node,
            f"grep -rlF {TOKEN} {BASE} /home /tmp /var/log /etc 2>/dev/null"
            f" | grep -vx {BASE}/secrets/hf_token",
        )
        assert found == "", f"the token is also in {found.split()} on {node}"
    for path in (ROOT / "runs" / run_id).rglob("*"):
        if path.is_file():
            _assert_no_token(str(path), path.read_text(errors="replace"))
    for path in (ROOT / ".cache" / "facts").glob("*"):
        _assert_no_token(f"the fact cache ({path})", path.read_text(errors="replace"))


def test_a_second_staging_of_the_same_model_sends_nothing_and_changes_nothing() -> None:
    _staged()
    done = _playbook(
        "molecule/train/stage_model.yml", "-e", "model=tiny", "-e", f"hf_token={TOKEN}"
    )
    assert done.returncode == 0, done.stdout[-4000:]
    assert set(_task_results(done.stdout, "Copy the model from the controller (nothing when")) == {
        f"ok: [{node}]" for node in NODES
    }
    assert set(_recap(done.stdout).values()) == {0}, _recap(done.stdout)


def test_preparing_the_nodes_again_after_a_tiny_run_changes_nothing() -> None:
    # The models directory has one owner (cluster_user): no role sets another mode on it.
    _staged()
    done = _playbook("molecule/shared/prepare.yml")
    assert done.returncode == 0, done.stdout[-4000:]
    assert set(_recap(done.stdout).values()) == {0}, done.stdout[-3000:]
    for node in NODES:
        assert _node(node, f"stat -c '%U %a' {BASE}/models").split() == ["llama", "775"]


def test_an_unreachable_hub_fails_before_launch_naming_endpoint_and_model() -> None:
    before = {node: _node(node, f"ls -la {BASE}/models {BASE}/models/hub") for node in NODES}
    done = _playbook(
        "train.yml",
        "-e",
        "model=mine",
        "-e",
        "model_path=llama-cluster/absent",
        "-e",
        "hf_endpoint=http://127.0.0.1:9",
    )
    said = _said(done.stdout)
    assert done.returncode != 0
    assert (
        "Model mine: (llama-cluster/absent, revision main, at http://127.0.0.1:9) the endpoint "
        "is unreachable from the controller" in said
    ), said[-3000:]
    assert "Train | Prepare every node" not in said
    for node in NODES:
        assert _node(node, f"ls -la {BASE}/models {BASE}/models/hub") == before[node]
        assert _node(node, f"ls -A {BASE}/models/hub/.partial 2>/dev/null") == ""


class _Hub(BaseHTTPRequestHandler):
    """Serves one directory as one Hugging Face repo at one commit; records every request."""

    files: ClassVar[dict[str, bytes]] = {}
    seen: ClassVar[list[tuple[str, str, str, str]]] = []
    refuse: str = ""

    def log_message(self, *_: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head: bool) -> None:
        path = self.path.split("?")[0]
        self.seen.append(
            (self.client_address[0], self.command, path, self.headers.get("Authorization", ""))
        )
        api = f"/api/models/{HUB_REPO}/"
        if path.startswith(api + "tree/"):
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                for name, data in sorted(self.files.items())
            ]
            self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
            return
        if path.startswith(api + "revision/"):
            info = {
                "id": HUB_REPO,
                "sha": COMMIT,
                "siblings": [{"rfilename": f} for f in self.files],
            }
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            return
        found = re.match(rf"^/{HUB_REPO}/resolve/[^/]+/(.+)$", path)
        name = found.group(1) if found else ""
        if name not in self.files:
            self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)
            return
        if name == self.refuse and not head:
            self._send(403, b"refused", {}, head)
            return
        data = self.files[name]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"'}
        self._send(200, data, headers, head)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)


def _oid(data: bytes) -> str:
    """The git blob id of a file, as the hub lists it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(scope="module")
def hub() -> Iterator[str]:
    """The endpoint of the stand-in hub, on the lab network's gateway (the nodes reach it)."""
    network = f"{PREFIX}-train"
    gateway = subprocess.run(
        ["docker", "network", "inspect", network, "-f", "{{(index .IPAM.Config 0).Gateway}}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if not gateway or not TINY.is_dir():
        pytest.skip(f"no gateway on {network} or no {TINY} (the tiny run makes it)")
    _Hub.files = {p.name: p.read_bytes() for p in TINY.iterdir() if p.is_file()}
    server = ThreadingHTTPServer((gateway, 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{gateway}:{server.server_address[1]}"
    server.shutdown()


def _stage_from_hub(endpoint: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return _playbook(
        "molecule/train/stage_model.yml",
        "-e",
        "model=tiny-hub",
        "-e",
        f"model_path={HUB_REPO}",
        "-e",
        f"hf_endpoint={endpoint}",
        "-e",
        f"hf_token={TOKEN}",
        # The stand-in hub is not huggingface.co: it gets the token only when trusted with it.
        "-e",
        "hf_token_to_endpoint=true",
        *extra,
    )


def test_a_hub_model_is_downloaded_once_per_node_whole_or_not_at_all(hub: str) -> None:
    node_ips = {_node(n, "hostname -i").split()[0] for n in NODES}
    # A downloader that cannot even start fails the play at once instead of being waited for.
    dead = _stage_from_hub(hub, "-e", "model_stage_python=/bin/false")
    assert dead.returncode != 0
    assert f"The downloader of {HUB_REPO} ended (exit status 1) without finishing" in _said(
        dead.stdout
    ), dead.stdout[-3000:]
    # A download that breaks half-way leaves nothing at the final path.
    _Hub.refuse, _Hub.seen = "model.safetensors", []
    broken = _stage_from_hub(hub)
    assert broken.returncode != 0
    assert f"The download of {HUB_REPO} failed" in _said(broken.stdout), broken.stdout[-3000:]
    partial = f"{BASE}/models/hub/.partial/huggingface--llama-cluster--tiny-hub--{COMMIT}"
    for node in NODES:
        assert _node(node, f"test -e {HUB_PATH} || echo absent").strip() == "absent"
        assert "config.json" in _node(node, f"ls {partial}")
    # The hub answers again: every node completes its download, with the token from its file.
    _Hub.refuse, _Hub.seen = "", []
    done = _stage_from_hub(hub, "-v")
    assert done.returncode == 0, done.stdout[-5000:]
    _assert_no_token("the play's output (-v)", done.stdout)
    said = _said(done.stdout)
    assert f"{HUB_REPO} from {hub} (huggingface), revision main = commit {COMMIT[:12]}" in said
    assert re.search(rf"{HUB_REPO}: ([\d.]+ kB) of \1 \(100 %\), 5 of 5 files, .* done in", said), (
        said
    )
    source = _local_sums(TINY)
    for node in NODES:
        staged = _sums(node, HUB_PATH)
        assert staged.pop(".llama-model.json", None), f"{node} has no completion marker"
        assert staged == source, f"{node} has another snapshot"
        marker = json.loads(_node(node, f"cat {HUB_PATH}/.llama-model.json"))
        assert (marker["repo"], marker["revision"], marker["files"]) == (HUB_REPO, COMMIT, 5)
        assert _node(node, f"ls -A {BASE}/models/hub/.partial | grep -v status.json") == ""
    fetched = {(ip, auth) for ip, method, path, auth in _Hub.seen if "/resolve/" in path}
    assert {ip for ip, _ in fetched} >= node_ips, "a node did not download"
    assert {auth for ip, auth in fetched if ip in node_ips} == {f"Bearer {TOKEN}"}
    # A node that has the snapshot fetches nothing.
    _Hub.seen = []
    again = _stage_from_hub(hub)
    assert again.returncode == 0, again.stdout[-4000:]
    assert set(_recap(again.stdout).values()) == {0}, _recap(again.stdout)
    assert not [s for s in _Hub.seen if s[0] in node_ips], "a node asked the hub again"
