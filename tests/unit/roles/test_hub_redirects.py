"""The hub's token never follows a redirect to another host (issue 40: the hub probe kept the
token's headers on a redirect to another host).

Two real HTTP servers on this machine record every request's headers: the "hub" (127.0.0.1)
redirects /away to the "other host" (`localhost`, another port) and /home to itself. The
controller's probe (llama.cluster.run_plan's hub_answer) and the nodes' download script
(roles/model_stage/files/llama-model-fetch, run in the training venv with the pinned
huggingface_hub and requests, as on a node) each ask them with a token and a cookie.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.action.run_plan import (
    MAX_REDIRECTS,
    hub_answer,
    redirect_headers,
)

ROOT = Path(__file__).resolve().parents[3]
FETCH = ROOT / "roles" / "model_stage" / "files" / "llama-model-fetch"
TRAIN_PYTHON = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON")
    or Path(os.environ.get("LLAMA_CLUSTER_CACHE", "/var/cache/llama-cluster"), "venv-train")
    / "bin"
    / "python"
)
TOKEN = "hf_FAKE_redirect_token_7d1e"
COOKIE = "m_session_id=FAKE-redirect-cookie-3a9f"


class Recorder(BaseHTTPRequestHandler):
    """Answers /landed with JSON; redirects /away to `elsewhere`, /home and /loop to itself."""

    seen: list[tuple[str, str, dict[str, str]]]
    elsewhere = ""

    def do_GET(self) -> None:
        self.seen.append(
            (self.server.name, self.path, {k.lower(): v for k, v in self.headers.items()})
        )
        targets = {"/away": f"{self.elsewhere}/landed", "/home": "/landed", "/loop": "/loop"}
        if self.path in targets:
            self.send_response(302)
            self.send_header("Location", targets[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"landed": self.server.name}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.fixture
def servers() -> Iterator[tuple[str, list]]:
    """The hub's URL and the list of (server, path, headers) both servers saw."""
    seen: list[tuple[str, str, dict[str, str]]] = []
    other = ThreadingHTTPServer(("127.0.0.1", 0), type("Other", (Recorder,), {"seen": seen}))
    other.name = "other"
    elsewhere = f"http://localhost:{other.server_address[1]}"
    hub = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Hub", (Recorder,), {"seen": seen, "elsewhere": elsewhere})
    )
    hub.name = "hub"
    for server in (hub, other):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{hub.server_address[1]}", seen
    for server in (hub, other):
        server.shutdown()
        server.server_close()


def _carried(seen: list, server: str, path: str) -> set[str]:
    """Which credentials the request to `server` for `path` carried."""
    (headers,) = [h for name, p, h in seen if (name, p) == (server, path)]
    return {name for name in ("authorization", "cookie") if name in headers}


# ---- the rule -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("there", "kept"),
    [
        ("https://huggingface.co/other/path", True),
        ("https://HuggingFace.co:443/x", True),  # the same host, its name in capitals
        ("https://cdn-lfs.huggingface.co/blob", False),
        ("http://huggingface.co/x", False),  # another scheme
        ("https://huggingface.co:8443/x", False),  # another port
        ("https://evil.example/x", False),
    ],
)
def test_credentials_are_kept_on_the_same_host_only(there: str, kept: bool) -> None:
    sent = {"Authorization": f"Bearer {TOKEN}", "Cookie": COOKIE, "User-Agent": "probe"}
    headers = redirect_headers(sent, "https://huggingface.co/org/m/resolve/main/config.json", there)
    assert headers["User-Agent"] == "probe"
    assert ("Authorization" in headers, "Cookie" in headers) == (kept, kept)


# ---- the controller's probe -----------------------------------------------------------------
def test_the_controllers_probe_drops_the_token_where_a_redirect_leaves_the_host(servers) -> None:
    hub, seen = servers
    sent = {"Authorization": f"Bearer {TOKEN}", "Cookie": COOKIE}
    away = hub_answer(f"{hub}/away", sent, 5, "")
    assert (away["status"], json.loads(away["content"])) == (200, {"landed": "other"})
    assert _carried(seen, "hub", "/away") == {"authorization", "cookie"}
    assert _carried(seen, "other", "/landed") == set()
    home = hub_answer(f"{hub}/home", sent, 5, "")
    assert json.loads(home["content"]) == {"landed": "hub"}
    assert _carried(seen, "hub", "/landed") == {"authorization", "cookie"}
    loop = hub_answer(f"{hub}/loop", sent, 5, "")
    assert loop["status"] == -1
    assert f"more than {MAX_REDIRECTS} redirects" in loop["msg"]


# ---- the nodes' download script -------------------------------------------------------------
DRIVER = """
import importlib.machinery, importlib.util, sys
loader = importlib.machinery.SourceFileLoader("fetch", sys.argv[1])
spec = importlib.util.spec_from_loader("fetch", loader)
fetch = importlib.util.module_from_spec(spec)
loader.exec_module(fetch)
hub, token, cookie = sys.argv[2], sys.argv[3], sys.argv[4]
fetch.keep_credentials_home(hub)
from huggingface_hub.utils import get_session
import requests
headers = {"authorization": f"Bearer {token}", "cookie": cookie}
session = get_session()
session.get(f"{hub}/away", headers=headers).raise_for_status()
session.get(f"{hub}/home", headers=headers).raise_for_status()
other = session.get(f"{hub}/away", headers=headers).url
session.get(str(other).replace("/landed", "/direct"), headers=headers).raise_for_status()
name, value = cookie.split("=")
requests.Session().get(
    f"{hub}/away", headers={"Authorization": f"Bearer {token}"}, cookies={name: value}
).raise_for_status()
"""


@pytest.mark.skipif(
    not TRAIN_PYTHON.is_file(),
    reason=f"no training venv at {TRAIN_PYTHON} (scripts/setup-train-venv.sh makes it)",
)
def test_the_nodes_download_sends_the_token_to_the_endpoints_host_alone(servers) -> None:
    hub, seen = servers
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", DRIVER, str(FETCH), hub, TOKEN, COOKIE],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    to_other = [(path, h) for name, path, h in seen if name == "other"]
    # huggingface_hub's client: redirected twice, asked directly once; requests: redirected once.
    assert [path for path, _ in to_other] == ["/landed", "/landed", "/direct", "/landed"]
    leaked = [(path, k) for path, h in to_other for k in ("authorization", "cookie") if k in h]
    assert leaked == []
    # A redirect on the endpoint's own host keeps the token (a gated model's files need it).
    (home,) = [h for name, path, h in seen if (name, path) == ("hub", "/landed")]
    assert home["authorization"] == f"Bearer {TOKEN}"
