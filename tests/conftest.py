"""What every test shares.

- The project's collection (llama.cluster) importable as Ansible imports it: Ansible's collection
  finder owns the `ansible_collections` package once anything starts Ansible's plugin loader in
  this process; it is started first, with the project's collections paths (as ansible.cfg names
  them), so that every test imports the plugins by their real names.
- DATA: the dataset files the checks are tried on. tests/data/datasets.json holds each one's exact
  text (broken ones included); they are written once per session into a directory of their own,
  beside tests/data/sharegpt_mixed.json (which molecule's train scenario reads too).
- The lab (inventory/lab.yml, which `make test` starts): `lab` drives it through the API,
  `lab_hosts` names its nodes in rank order, `provisioned` runs provision.yml on it once for the
  whole session (the runner's tests, tests/lab/test_lab.py's checks of a provisioned node). They
  skip
  when the lab is not up.
- The parallel run (`make test`: pytest-xdist, `--dist loadgroup`): a worker runs an xdist group
  whole. Every test marked `lab` is in the group `lab` (they share inventory/lab.yml and the lab's
  nodes); each molecule scenario is a group of its own (tests/molecule/test_molecule.py); the other
  tests
  have none and spread over the workers. Each worker orders its collection as `_queue` says, so
  that the longest groups start first.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from itertools import islice
from pathlib import Path

import pytest
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader
from ansible.vars.manager import VariableManager

ROOT = Path(__file__).resolve().parents[1]

init_plugin_loader([str(ROOT / "collections"), str(ROOT / ".cache" / "collections")])

# After the finder: llama_runner and the tests load the collection's plugins through it.
from ansible_collections.llama.cluster.plugins.module_utils.inventory import (  # noqa: E402
    cluster_ranks,
    global_ranks,
)

from tests.support.node_usage import fake_proc  # noqa: E402
from train_runner import DEFAULT_INVENTORY, Cluster  # noqa: E402


def _materialise_datasets() -> Path:
    where = Path(tempfile.mkdtemp(prefix="llama-datasets-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    sources = ROOT / "tests" / "data"
    texts = json.loads((sources / "datasets.json").read_text(encoding="utf-8"))
    for name, text in texts.items():
        (where / name).write_text(text, encoding="utf-8")
    shutil.copy2(sources / "sharegpt_mixed.json", where / "sharegpt_mixed.json")
    return where


DATA = _materialise_datasets()


@pytest.fixture
def test_net_inventory(tmp_path: Path) -> Path:
    """Two CPU nodes at TEST-NET addresses (192.0.2.1, .2) that nothing answers: a request that
    got past the controller's checks fails on "unreachable" instead of its refusal."""
    inventory = tmp_path / "inventory.yml"
    node = '{"ansible_host": "192.0.2.%d", "cluster_accelerator": "cpu", "nproc_per_node": 1}'
    inventory.write_text(
        "all:\n  children:\n    cluster:\n      children:\n"
        f"        master:\n          hosts:\n            a: {node % 1}\n"
        f"        workers:\n          hosts:\n            b: {node % 2}\n"
    )
    return inventory


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc with another user's process on a GPU (tests/support/node_usage.py)."""
    return fake_proc(tmp_path)


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    """A cluster of one host, the controller itself (no SSH)."""
    path = tmp_path / "local.yml"
    path.write_text(
        "all:\n"
        "  children:\n"
        "    cluster:\n"
        "      children:\n"
        "        master:\n"
        "          hosts:\n"
        "            localhost:\n"
        "              ansible_connection: local\n"
        "              ansible_python_interpreter: '{{ ansible_playbook_python }}'\n"
    )
    return path


@pytest.fixture
def cluster(tmp_path: Path, local_inventory: Path) -> Cluster:
    """The API on the controller alone (local_inventory), keeping 3 runs' artifacts."""
    return Cluster(local_inventory, private_data_dir=tmp_path / "runner", keep_artifacts=3)


@pytest.fixture(scope="session")
def lab() -> Cluster:
    if not DEFAULT_INVENTORY.is_file():
        pytest.skip(f"{DEFAULT_INVENTORY} is absent: start the lab with `make lab`")
    return Cluster()


def _read_inventory(inventory: Path) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """Ansible's own reading of an inventory: its groups and every host's variables."""
    loader = DataLoader()
    hosts = InventoryManager(loader=loader, sources=[str(inventory)])
    variables = VariableManager(loader=loader, inventory=hosts)
    hostvars = {host.name: variables.get_vars(host=host) for host in hosts.get_hosts()}
    return hosts.get_groups_dict(), hostvars


def ranked_hosts(inventory: Path) -> list[str]:
    """The inventory's nodes in rank order, as train.yml ranks them (llama.cluster's
    cluster_ranks over Ansible's own reading of the inventory)."""
    groups, hostvars = _read_inventory(inventory)
    ranks = cluster_ranks(groups, hostvars)
    return sorted(ranks, key=ranks.__getitem__)


@pytest.fixture(scope="session")
def lab_hosts(lab: Cluster) -> list[str]:
    """The lab's nodes, master first."""
    return ranked_hosts(DEFAULT_INVENTORY)


@pytest.fixture(scope="session")
def lab_ranks(lab: Cluster) -> dict[str, list[int]]:
    """The global ranks of every lab node's training processes (the lab runs two per node)."""
    groups, hostvars = _read_inventory(DEFAULT_INVENTORY)
    return global_ranks(groups, hostvars)


@pytest.fixture(scope="session")
def provisioned(lab: Cluster, lab_hosts: list[str]) -> Cluster:
    """The lab after provision.yml, run once for the session through the API."""
    result = lab.provision()
    assert result.ok
    assert set(result.hosts) >= set(lab_hosts)
    assert not any(s.failed or s.unreachable for s in result.hosts.values())
    return lab


# Each group's time in CI's rehearsal, in seconds (CONTRIBUTING.md, "Tests and CI's time"): only
# their order matters. A group not listed here counts as 1, after these, before the unit tests.
GROUP_SECONDS = {
    "molecule-train": 1944,
    "lab": 1803,
    "molecule-cluster": 380,
    "molecule-in_use": 187,
}
# Tests without a group after each group that did not start at once: the worker that takes the
# group takes them too, so the next group goes to another worker rather than queue behind it.
FREE_AFTER_GROUP = 2


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def _queue(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The order the workers take the tests in (xdist hands out work units in collection order,
    and a worker with at most 2 tests left is given one more unit).

    The `workers` longest groups come first, one per worker, then `workers` tests without a group
    (the second unit each of those workers is given at the start, which waits behind the group);
    then each remaining group, longest first, followed by FREE_AFTER_GROUP tests without one; then
    the rest in the files' order."""
    groups: dict[str, list[pytest.Item]] = {}
    free: list[pytest.Item] = []
    for item in items:
        name = _group(item)
        if name is None:
            free.append(item)
        else:
            groups.setdefault(name, []).append(item)
    longest = sorted(groups, key=lambda name: -GROUP_SECONDS.get(name, 1))
    rest = iter(free)
    queue = [item for name in longest[:workers] for item in groups[name]]
    queue += islice(rest, workers)
    for name in longest[workers:]:
        queue += [*groups[name], *islice(rest, FREE_AFTER_GROUP)]
    return [*queue, *rest]


def _name_group(item: pytest.Item) -> None:
    """Give the test's nodeid the suffix `@<group>`, by which xdist's loadgroup keeps a group on
    one worker. xdist 3.8's own hook writes it to Item._nodeid, which pytest 9 no longer reads (the
    nodeid is Item._id, a NodeId): without this, every test of a group is a unit of its own."""
    group = _group(item)
    if group is None or item.nodeid.endswith(f"@{group}"):
        return
    nodeid = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        item._id = type(item._id).parse(nodeid)
    else:
        item._nodeid = nodeid


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("lab") is not None and _group(item) is None:
            item.add_marker(pytest.mark.xdist_group("lab"))
    # Only on xdist's workers (they all order it the same way); a sequential run keeps the order.
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    items[:] = _queue(items, int(workerinput["workercount"]))
    if config.getvalue("loadgroup"):
        for item in items:
            _name_group(item)
