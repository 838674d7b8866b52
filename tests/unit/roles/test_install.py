"""`pip install .` gives the `llama-cluster` command, and the installed command drives the checkout
it runs in: a bad request is refused by train.yml's first play, on the controller."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project installed (not editable) into a target directory; its bin/llama-cluster.

    Installed from a copy of what the package is made of, so that the build leaves nothing in
    the tree."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "train_runner.py"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "llama_runner", source / "llama_runner")
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
         "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    command = target / "bin" / "llama-cluster"
    assert command.is_file()
    return command


def _run(command: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(command.parents[1]), "NO_COLOR": "1"}
    env.pop("LLAMA_CLUSTER_DIR", None)
    return subprocess.run(
        [sys.executable, str(command), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_the_installed_command_is_the_cli(installed: Path) -> None:
    done = _run(installed, "--help", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "usage: llama-cluster" in done.stdout
    for verb in ("provision", "train", "status", "stop"):
        assert verb in done.stdout


def test_the_installed_command_finds_the_checkout_it_runs_in(installed: Path) -> None:
    # The copy in the target directory, not the tree's llama_runner, runs: it finds the project
    # from the current directory, and train.yml refuses the unknown model before any node.
    inventory = str(ROOT / "inventory/example/hosts.yml")
    done = _run(installed, "-i", inventory, "train", "--model", "no-such-model", cwd=ROOT / "roles")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Unknown model" in done.stdout + done.stderr


def test_outside_a_checkout_it_says_where_to_run(installed: Path, tmp_path: Path) -> None:
    done = _run(installed, "status", cwd=tmp_path)
    assert done.returncode == 2
    assert "is not a llama-cluster checkout" in done.stdout + done.stderr
    assert "LLAMA_CLUSTER_DIR" in done.stdout + done.stderr


# scripts/bootstrap-host.sh decides in seconds: ready, or one line naming what is missing and how.
#
# Real commands and exit codes: the script runs with a PATH that lacks some tools (a folder of links
# to the real ones), as the user nobody (setpriv), or with /run hidden in a private mount namespace
# (no Docker socket). No case here installs a package or starts a daemon.

SCRIPT = "scripts/bootstrap-host.sh"
TOOLS = ("bash", "id", "timeout", "seq", "sleep", "setsid", "make", "python3", "rsync")
TOOLS += ("debootstrap", "docker", "dockerd", "apt-get", "chromium")
SETPRIV = shutil.which("setpriv") or "setpriv"
NOBODY = [SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups"]
FIX = f"run sudo {SCRIPT}"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv (to run the script as another user)",
)


@pytest.fixture
def bin_dir() -> Iterator[Path]:
    """A folder any user can read, to hold links to the real tools the script may find."""
    with tempfile.TemporaryDirectory(prefix="bootstrap-bin-") as tmp:
        os.chmod(tmp, stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        yield Path(tmp)


def tools_path(bin_dir: Path, without: tuple[str, ...] = ()) -> str:
    """Link every tool of TOOLS that this machine has, except `without`; return it as a PATH."""
    for tool in TOOLS:
        # The system's python3 first: the controller's may live where other users cannot go.
        real = shutil.which(tool, path="/usr/bin:/bin") or shutil.which(tool)
        if real and tool not in without:
            (bin_dir / tool).symlink_to(real)
    return str(bin_dir)


def run(
    argv: list[str], path: str | None = None, extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run argv from the repository root; return the result and its wall time."""
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    env.update(extra or {}, PATH=path or os.environ["PATH"])
    started = time.monotonic()
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    return done, time.monotonic() - started


def one_error(done: subprocess.CompletedProcess[str]) -> str:
    """The script failed with exactly one line, on stderr, and nothing on stdout."""
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def docker_up() -> bool:
    """Whether this machine's Docker daemon answers."""
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def test_ready_machine_passes_quietly() -> None:
    if not docker_up():
        pytest.skip("no Docker daemon here")
    done, took = run([SCRIPT, "--with", "rsync"])
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert took < 5


def test_not_root_without_docker_names_the_package_and_sudo(bin_dir: Path) -> None:
    path = tools_path(bin_dir, without=("docker", "dockerd"))
    done, took = run([*NOBODY, SCRIPT], path)
    assert one_error(done) == f"error: missing docker.io and this is not root: {FIX}"
    assert took < 5


def test_root_without_apt_names_what_to_install(bin_dir: Path) -> None:
    path = tools_path(bin_dir, without=("docker", "dockerd", "rsync", "apt-get"))
    done, _ = run([SCRIPT, "--with", "no-such-tool"], path)
    missing = "error: missing docker.io rsync no-such-tool and this machine has no apt-get: "
    assert one_error(done).startswith(missing)


def test_not_root_without_daemon_says_sudo(bin_dir: Path) -> None:
    """/run hidden by an empty tmpfs in a private mount namespace: no socket, no daemon."""
    unshare, mount, sh = (shutil.which(tool) for tool in ("unshare", "mount", "sh"))
    if not (unshare and mount and sh):
        pytest.skip("no unshare or mount")
    path = tools_path(bin_dir)
    hide_run = f"{mount} -t tmpfs none /run && exec {' '.join(NOBODY)} {SCRIPT}"
    done, took = run([unshare, "--mount", "--propagation", "private", sh, "-c", hide_run], path)
    if "mount" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip("mount namespaces are not allowed here")
    assert one_error(done) == f"error: the Docker daemon is not running and this is not root: {FIX}"
    assert took < 5


def test_not_root_outside_docker_group_says_usermod() -> None:
    if not docker_up() or not Path("/var/run/docker.sock").is_socket():
        pytest.skip("no Docker daemon on the default socket here")
    done, _ = run([*NOBODY, SCRIPT])
    assert "may not use it: run sudo usermod -aG docker nobody" in one_error(done)


def test_other_daemon_is_not_started_here() -> None:
    """Root, DOCKER_HOST pointing at a socket nobody listens on: it says so, starts nothing."""
    done, took = run([SCRIPT], extra={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert one_error(done).startswith(
        "error: the Docker daemon at DOCKER_HOST=unix:///nonexistent/docker.sock does not answer"
    )
    assert took < 5


@pytest.mark.parametrize("target", ["test", "demo"])
def test_make_without_docker_stops_at_once(bin_dir: Path, target: str) -> None:
    """`make test` and `make demo` fail before setting up anything, with the script's line."""
    path = tools_path(bin_dir, without=("docker", "dockerd"))
    done, took = run([*NOBODY, "make", "--no-print-directory", target], path)
    assert done.returncode != 0
    # make test also needs chromium (it renders TensorBoard in the train scenario).
    missing = "docker.io" + (
        " chromium" if target == "test" and not shutil.which("chromium") else ""
    )
    assert f"error: missing {missing} and this is not root: {FIX}" in done.stderr.splitlines()
    assert "setup:" not in done.stdout
    assert took < 5
