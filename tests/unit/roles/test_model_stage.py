"""Where a run's model comes from: the staging decisions, the hub probe's verdicts, the tiny
model generated without torch, and a hub that cannot be reached failing on the controller.

The end-to-end staging (copies, downloads, tokens) runs on real nodes in
molecule/train/tests/test_models.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter.model_stage import model_stage_escapes
from ansible_collections.llama.cluster.plugins.module_utils.planner import model as stage
from ansible_collections.llama.cluster.plugins.modules import llama_model_progress as progress

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
TRAIN_PYTHON = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "/var/cache/llama-cluster/venv-train/bin/python")
)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


SETTINGS = {
    "hub": "huggingface",
    "hub_dir": "/opt/llama-cluster/models/hub",
    "models_dir": "/opt/llama-cluster/models",
    "generated_dir": "/home/me/.cache/llama-cluster/models/tiny",
    "endpoints": {
        "huggingface": "https://hf-mirror.com/",
        "modelscope": "https://www.modelscope.cn",
    },
}


def source(entry: dict, **settings: object) -> dict:
    return stage.model_stage_source(entry, "m", {**SETTINGS, **settings})


def test_a_hub_id_is_downloaded_into_the_hub_cache_from_the_configured_mirror() -> None:
    request = source({"path": "Qwen/Qwen2.5-7B-Instruct"})
    assert request["error"] == ""
    assert request["kind"] == "hub"
    assert (request["hub"], request["revision"]) == ("huggingface", "main")
    assert request["endpoint"] == "https://hf-mirror.com"
    assert request["probe_url"] == (
        "https://hf-mirror.com/Qwen/Qwen2.5-7B-Instruct/resolve/main/config.json"
    )
    assert (
        request["path"]
        == "/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen2.5-7B-Instruct/main"
    )


def test_modelscope_uses_its_own_id_api_and_default_revision() -> None:
    entry = {"path": "meta-llama/Meta-Llama-3-8B-Instruct", "hub": "modelscope"}
    request = source({**entry, "modelscope_path": "LLM-Research/Meta-Llama-3-8B-Instruct"})
    assert request["repo"] == "LLM-Research/Meta-Llama-3-8B-Instruct"
    assert request["revision"] == "master"
    assert request["probe_url"] == (
        "https://www.modelscope.cn/api/v1/models/LLM-Research/Meta-Llama-3-8B-Instruct/repo"
        "?Revision=master&FilePath=config.json"
    )
    assert source({"path": "Qwen/Qwen3-8B"}, hub="modelscope")["hub"] == "modelscope"


def test_a_controller_directory_is_copied_under_the_models_directory() -> None:
    request = source({"path": "/data/checkpoints/my-qwen/"})
    assert (request["kind"], request["source"]) == ("controller", "/data/checkpoints/my-qwen")
    digest = hashlib.sha256(b"/data/checkpoints/my-qwen").hexdigest()[:12]
    assert request["path"] == f"/opt/llama-cluster/models/my-qwen-{digest}"
    assert request["path"] in request["summary"]
    home = source({"path": "~/models/x"})
    assert home["source"] == os.path.expanduser("~/models/x")


def test_two_controller_directories_of_one_name_are_two_node_directories() -> None:
    """.../exp1/checkpoint-500 and .../exp2/checkpoint-500 were one node directory, which rsync
    --delete turned from one into the other: a resume then trained on the wrong weights."""
    first = source({"path": "/data/exp1/checkpoint-500"})["path"]
    second = source({"path": "/data/exp2/checkpoint-500"})["path"]
    assert first != second
    assert {posixpath.dirname(first), posixpath.dirname(second)} == {"/opt/llama-cluster/models"}
    assert posixpath.basename(first).startswith("checkpoint-500-")
    # One directory, however it is written, is one node directory (a run staged again reuses it).
    again = source({"path": "/data/exp1/./checkpoint-500/"})["path"]
    assert again == first


def test_a_shared_directory_is_used_where_it_is() -> None:
    request = source({"path": "/mnt/nfs/qwen", "shared": "true"})
    assert (request["kind"], request["path"], request["error"]) == ("shared", "/mnt/nfs/qwen", "")


def test_the_generated_tiny_model_is_a_controller_directory() -> None:
    request = source({"path": "ignored", "generated": True})
    assert request["kind"] == "controller"
    assert request["generated"] is True
    assert request["source"] == SETTINGS["generated_dir"]
    assert request["path"] == "/opt/llama-cluster/models/tiny"


@pytest.mark.parametrize(
    ("entry", "settings", "message"),
    [
        ({}, {}, "no path"),
        ({"path": "not a repo"}, {}, "neither a hub id"),
        ({"path": "Qwen/Qwen3-8B", "revision": "../x"}, {}, "not a branch, tag or commit"),
        ({"path": "Qwen/Qwen3-8B", "hub": "github"}, {}, "unknown hub 'github'"),
        ({"path": "Qwen/Qwen3-8B", "shared": True}, {}, "not a directory: shared storage"),
        ({"path": "~/m", "shared": True}, {}, "must be an absolute path"),
        ({"path": "/data/hub"}, {}, "cannot be copied under /opt/llama-cluster/models"),
        (
            {"path": "Qwen/Qwen3-8B"},
            {"endpoints": {"huggingface": "hf-mirror.com", "modelscope": ""}},
            "hf_endpoint='hf-mirror.com' is not an http(s) URL",
        ),
    ],
)
def test_bad_requests_say_what_is_wrong(entry: dict, settings: dict, message: str) -> None:
    error = source(entry, **settings)["error"]
    assert error.startswith("Model m: ")
    assert message in error


def _probed(answer: dict, token: bool = False, **entry: str) -> dict:
    request = source({"path": "Qwen/Qwen3-8B", **entry})
    return stage.model_stage_probe(request, answer, token, SETTINGS["hub_dir"])


def test_an_answer_pins_the_request_to_the_hubs_commit() -> None:
    config = {"model_type": "qwen3", "hidden_size": 4096}
    pinned = _probed({"status": 200, "content": json.dumps(config), "x_repo_commit": COMMIT})
    assert pinned["error"] == ""
    assert pinned["config"] == config
    assert pinned["commit"] == COMMIT
    assert pinned["path"] == f"/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen3-8B/{COMMIT}"
    assert "revision main = commit 0123456789ab" in pinned["summary"]
    # A mirror that names no commit: the revision's name keys the cache.
    assert _probed({"status": 200, "content": "{}"})["path"].endswith("/Qwen--Qwen3-8B/main")


@pytest.mark.parametrize(
    ("answer", "token", "message"),
    [
        (
            {
                "status": -1,
                "msg": "Status code was -1 and not [200]: Request failed: "
                "<urlopen error [Errno 111] Connection refused>",
            },
            False,
            "the endpoint is unreachable from the controller ([Errno 111] Connection refused)",
        ),
        ({"status": 401, "x_error_code": "GatedRepo"}, False, "gated or private (HTTP 401)"),
        ({"status": 403}, True, "the token (hf_token) was refused (HTTP 403)"),
        ({"status": 401, "x_error_code": "RepoNotFound"}, False, "has no model Qwen/Qwen3-8B"),
        ({"status": 404, "x_error_code": "RevisionNotFound"}, False, "no revision main"),
        ({"status": 404, "x_error_code": "EntryNotFound"}, False, "has no config.json"),
        ({"status": 502}, False, "answered HTTP 502"),
        ({"status": 200, "content": "<html>"}, False, "config.json is not JSON"),
    ],
)
def test_a_failed_probe_names_the_model_and_the_endpoint(
    answer: dict, token: bool, message: str
) -> None:
    error = _probed(answer, token)["error"]
    assert error.startswith("Model m: (Qwen/Qwen3-8B, revision main, at https://hf-mirror.com) ")
    assert message in error
    assert error.endswith("Nothing was changed on any node.")


REFUSED = {
    "status": -1,
    "msg": "Status code was -1 and not [200]: Request failed: <urlopen error [Errno 111] "
    "Connection refused>",
}


def test_an_unreachable_hub_asked_from_the_master_too_names_both_and_the_way_around() -> None:
    request = source({"path": "Qwen/Qwen3-8B"})
    error = stage.model_stage_probe(request, REFUSED, False, "/hub", asker="the master gpu1")[
        "error"
    ]
    assert (
        "the endpoint is unreachable from the controller, and from the master gpu1 ([Errno 111]"
        in (error)
    )
    assert "Without the hub, -e model_params_b=<billions> plans it from its size." in error
    # A hub that answered (a 404) is not a way around: the model is not there.
    missing = _probed({"status": 404, "x_error_code": "RepoNotFound"})["error"]
    assert "Without the hub" not in missing


def test_the_masters_answer_keeps_what_the_probe_reads_and_never_the_request() -> None:
    registered = {
        "status": 200,
        "content": "{}",
        "x_repo_commit": COMMIT,
        "changed": False,
        "invocation": {"module_args": {"headers": {"Authorization": "Bearer hf_secret"}}},
    }
    answer = stage.model_stage_answer(registered)
    assert answer == {"status": 200, "content": "{}", "x_repo_commit": COMMIT}
    # A config.json is a few kB: a larger answer is kept no further than the controller reads.
    flood = stage.model_stage_answer({"status": 200, "content": "x" * (5 << 20)})
    assert len(flood["content"]) == stage.MAX_ANSWER_BYTES
    # Not asked (the task was skipped, or nothing was given): no answer at all.
    for none in ({"skipped": True, "changed": False}, {}, None, ""):
        assert stage.model_stage_answer(none) == {}
    # A master that did not answer: an answer without a connection, that says why.
    lost = {"unreachable": True, "msg": "Failed to connect to the host via ssh: timed out"}
    assert stage.model_stage_answer(lost) == {
        "status": -1,
        "msg": "Request failed: the master did not answer: Failed to connect to the host via "
        "ssh: timed out",
    }


def test_the_token_rides_in_the_headers_only_where_it_may_go() -> None:
    assert stage.model_stage_headers("hf_x") == {
        "Authorization": "Bearer hf_x",
        "Cookie": "m_session_id=hf_x",
    }
    for token, send in (("hf_x", False), ("hf_x", "false"), ("", True), (None, True)):
        assert stage.model_stage_headers(token, send) == {}


@pytest.mark.parametrize(
    ("status", "reached"),
    [
        *((status, False) for status in (-1, 0, None, "x", 500, 502, 503)),
        *((status, True) for status in (200, 401, 404)),
    ],
)
def test_no_connection_or_a_gateways_error_is_no_answer(status: object, reached: bool) -> None:
    assert stage.model_stage_reached({"status": status}) is reached


def test_without_the_hub_a_catalogue_model_is_planned_unpinned_and_says_so() -> None:
    request = source({"path": "Qwen/Qwen3-8B"})
    config = {"model_type": "qwen3", "hidden_size": 4096}
    unpinned = stage.model_stage_unpinned(request, config, REFUSED, "the controller")
    assert (unpinned["error"], unpinned["commit"], unpinned["config"]) == ("", "", config)
    assert unpinned["path"] == "/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen3-8B/main"
    assert unpinned["summary"] == (
        "Qwen/Qwen3-8B from https://hf-mirror.com (huggingface), revision main, not pinned to a "
        "commit: the controller gets no answer from the hub ([Errno 111] Connection refused); "
        "planned with the config that group_vars/all/models.yml carries. Each node downloads "
        "main as the hub serves it when its download starts, into "
        "/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen3-8B/main (a node that has that "
        "directory keeps its snapshot), so nodes can hold different commits: "
        "-e model_revision=<commit> gives every node the same one"
    )
    # Asked from the master as well, which got a gateway's error; the size alone, no config.
    sized = stage.model_stage_unpinned(request, {}, {"status": 503}, "the master gpu1")
    assert (
        "neither the controller nor the master gpu1 gets an answer from the hub (the master "
        "gpu1: HTTP 503); planned from the size given (-e model_params_b), without config.json"
    ) in sized["summary"]


def test_without_the_hub_a_commit_given_as_the_revision_is_pinned() -> None:
    request = source({"path": "Qwen/Qwen3-8B", "revision": COMMIT})
    pinned = stage.model_stage_unpinned(request, {"model_type": "qwen3"}, REFUSED, "the controller")
    assert pinned["commit"] == COMMIT
    assert pinned["path"] == f"/opt/llama-cluster/models/hub/huggingface/Qwen--Qwen3-8B/{COMMIT}"
    assert "not pinned" not in pinned["summary"]
    assert f"revision {COMMIT} (a commit)" in pinned["summary"]


@pytest.mark.parametrize(
    ("endpoint", "to_endpoint", "send"),
    [
        ("https://huggingface.co", False, True),
        ("https://huggingface.co/", False, True),
        ("https://HuggingFace.co:443", False, True),
        ("https://hf.co", False, True),
        ("https://cdn-lfs.huggingface.co", False, True),
        ("https://hf-mirror.com", False, False),  # a third-party mirror
        ("https://huggingface.co.evil.example", False, False),  # only looks like it
        ("https://evil.example/huggingface.co", False, False),
        ("https://myhuggingface.co", False, False),
        ("http://huggingface.co", False, False),  # in clear text
        ("not a url", False, False),
        ("https://hf-mirror.com", True, True),  # trusted by the user
        ("https://hf-mirror.com", "true", True),  # -e hf_token_to_endpoint=true
        ("https://hf-mirror.com", "false", False),
    ],
)
def test_the_hf_token_goes_to_huggingface_co_unless_the_endpoint_is_trusted(
    endpoint: str, to_endpoint: object, send: bool
) -> None:
    policy = stage.model_stage_token_policy("huggingface", endpoint, True, to_endpoint)
    assert policy["send"] is send
    if send:
        assert policy["note"] == ""
    else:
        assert endpoint in policy["note"]
        assert "hf_token_to_endpoint=true" in policy["note"]


def test_no_token_means_nothing_to_send_or_say() -> None:
    assert stage.model_stage_token_policy("huggingface", "https://hf-mirror.com", False) == {
        "send": False,
        "note": "",
    }


def test_the_modelscope_token_goes_to_its_endpoint() -> None:
    policy = stage.model_stage_token_policy("modelscope", "https://www.modelscope.cn", True)
    assert policy == {"send": True, "note": ""}


@pytest.mark.parametrize(
    "answer",
    [{"status": 401, "x_error_code": "GatedRepo"}, {"status": 401, "x_error_code": "RepoNotFound"}],
)
def test_a_gated_model_behind_a_mirror_names_the_withheld_token(answer: dict) -> None:
    note = stage.model_stage_token_policy("huggingface", "https://hf-mirror.com", True)["note"]
    request = stage.model_stage_source({"path": "Qwen/Qwen3-8B"}, "m", SETTINGS)
    error = stage.model_stage_probe(request, answer, False, SETTINGS["hub_dir"], note)["error"]
    assert "hf_token is set but not sent to https://hf-mirror.com" in error
    assert "hf_token_to_endpoint=true" in error


def test_modelscope_refusals_in_a_200_answer_are_failures() -> None:
    answer = {"status": 200, "content": json.dumps({"Success": False, "Message": "not exist"})}
    assert "not exist" in _probed(answer, hub="modelscope")["error"]


def test_progress_lines_read_like_a_download() -> None:
    line = progress.progress_line(
        "Qwen/Qwen3-8B",
        {
            "state": "downloading",
            "bytes_done": 5_100_000_000,
            "bytes_total": 15_200_000_000,
            "files_done": 3,
            "files_total": 12,
            "rate": 48_200_000,
        },
    )
    assert line == (
        "Qwen/Qwen3-8B: 5.1 GB of 15.2 GB (34 %), 3 of 12 files, 48.2 MB/s, about 3.5 min left"
    )
    assert progress.progress_line("x", {"state": "listing"}) == "x: listing the files"


def test_the_progress_poll_notices_a_downloader_that_ended_without_a_word(tmp_path: Path) -> None:
    job = tmp_path / "job"
    assert progress.job_ended(None) is None
    assert progress.job_ended(str(job)) is None  # not written yet
    job.write_text(json.dumps({"started": 1, "finished": 0, "ansible_job_id": "1"}))
    assert progress.job_ended(str(job)) is None  # still running
    job.write_text(json.dumps({"rc": 1, "stderr": "boom", "cmd": ["x"]}))
    assert progress.job_ended(str(job))["rc"] == 1


def _make_tiny(directory: Path) -> dict:
    script = ROOT / "scripts/make_tiny_model.py"
    done = subprocess.run(
        [sys.executable, str(script), str(directory)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_the_tiny_model_is_made_with_the_standard_library_and_is_the_same_everywhere(
    tmp_path: Path,
) -> None:
    first, second = _make_tiny(tmp_path / "a" / "tiny"), _make_tiny(tmp_path / "b" / "tiny")
    assert first["sha256"] == second["sha256"]
    assert first["parameters"] == 11152
    made = sorted(p.name for p in (tmp_path / "a" / "tiny").iterdir())
    assert made == [
        "config.json",
        "model.safetensors",
        "tiny_model.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not list((tmp_path / "a").glob(".tiny.partial-*")), "a partial directory was left"
    blob = (tmp_path / "a" / "tiny" / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size])
    assert header["model.embed_tokens.weight"]["shape"] == [400, 16]
    assert (
        hashlib.sha256(blob).hexdigest()
        == hashlib.sha256((tmp_path / "b" / "tiny" / "model.safetensors").read_bytes()).hexdigest()
    )


def test_transformers_loads_the_tiny_model_without_missing_weights(tmp_path: Path) -> None:
    if not TRAIN_PYTHON.exists():
        pytest.skip(f"no training venv at {TRAIN_PYTHON}: run scripts/setup-train-venv.sh")
    _make_tiny(tmp_path / "tiny")
    check = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], output_loading_info=True)
ids = tok("<|im_start|>user\\nthe cluster trains 12 + 3 = 15.<|im_end|>")["input_ids"]
loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
seen = {"missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"])}
seen |= {"eos": tok.eos_token, "pad": tok.pad_token, "text": tok.decode(ids), "loss": loss}
print(json.dumps(seen))
"""
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", check, str(tmp_path / "tiny")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["missing"] == []
    assert seen["unexpected"] == []
    assert (seen["eos"], seen["pad"]) == ("<|im_end|>", "<|endoftext|>")
    assert seen["text"] == "<|im_start|>user\nthe cluster trains 12 + 3 = 15.<|im_end|>"
    assert 5.0 < seen["loss"] < 7.0, "an untrained 400-token model starts near ln(400) = 6.0"


def test_an_unreachable_modelscope_refuses_a_model_outside_the_catalogue_naming_it(
    tmp_path: Path, test_net_inventory: Path
) -> None:
    # TEST-NET nodes: a request that got past the probe would fail on "unreachable" instead.
    # The controller gets no answer, so the master is asked, and it does not answer either. (A
    # catalogue model is planned with its catalogue's config instead:
    # tests/unit/planner/test_run_plan_action.py;
    # Hugging Face, with a look at the nodes: molecule/train/tests/test_models.py.)
    inventory = test_net_inventory
    request = ["-e", "model=mine", "-e", "model_path=Qwen/Qwen2.5-7B-Instruct"]
    request += ["-e", "model_template=qwen", "-e", "model_hub=modelscope"]
    endpoint = ["-e", "modelscope_endpoint=http://127.0.0.1:9"]
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), "train.yml", *request, *endpoint],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        # A master at a TEST-NET address that drops packets fails in seconds, not in 30.
        env={"ANSIBLE_NOCOLOR": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        | {"ANSIBLE_TIMEOUT": "5"},
    )
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0
    assert (
        "Model mine: (Qwen/Qwen2.5-7B-Instruct, revision master, at http://127.0.0.1:9) the "
        "endpoint is unreachable from the controller, and from the master a (the master did not "
        "answer: " in out
    ), out[-2000:]
    assert "Check modelscope_endpoint" in out
    assert "Train | Prepare every node" not in out, "a node was contacted"


def _local_nodes(tmp_path: Path) -> Path:
    """Two local-connection nodes: nothing leaves this machine."""
    inventory = tmp_path / "inventory.yml"
    node = json.dumps(
        {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "cluster_accelerator": "cpu",
            "nproc_per_node": 1,
        }
    )
    inventory.write_text(
        "all:\n  children:\n    cluster:\n      children:\n"
        f"        master:\n          hosts:\n            a: {node}\n"
        f"        workers:\n          hosts:\n            b: {node}\n"
    )
    return inventory


def _without_rsync(tmp_path: Path) -> str:
    """A PATH with every tool of /usr/bin but rsync."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name != "rsync":
            (bin_dir / tool.name).symlink_to(tool)
    return str(bin_dir)


def _run_without_rsync(tmp_path: Path, playbook: str, *extra: str, path: str) -> str:
    """ansible-playbook on the two local nodes; its output on one line (it must fail)."""
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(_local_nodes(tmp_path)), playbook, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"ANSIBLE_NOCOLOR": "1", "PATH": path, "HOME": str(tmp_path)},
    )
    assert done.returncode != 0
    return " ".join((done.stdout + done.stderr).split())


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    return model


def test_a_node_without_rsync_is_named_before_the_model_is_copied(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    extra = [f"node_path={_without_rsync(tmp_path)}", f"model_source={_model(tmp_path)}"]
    extra += [f"model_dest={dest}", f"hub_cache_dir={tmp_path / 'hub'}"]
    out = _run_without_rsync(
        tmp_path,
        "tests/playbooks/stage_model.yml",
        *(arg for value in extra for arg in ("-e", value)),
        path=os.environ["PATH"],
    )
    assert "copied from the controller with rsync, which a, b lacks" in out, out[-2000:]
    assert "-e model_shared=true" in out
    assert not (tmp_path / "hub").exists(), "a node was written to before the check"
    assert not dest.exists()


def test_a_controller_without_rsync_stops_train_yml_before_any_node(tmp_path: Path) -> None:
    request = ["model=mine", f"model_path={_model(tmp_path)}", "model_template=qwen"]
    out = _run_without_rsync(
        tmp_path,
        "train.yml",
        *(arg for value in request for arg in ("-e", value)),
        path=_without_rsync(tmp_path),
    )
    assert "with rsync, which the controller lacks" in out, out[-2000:]
    assert "Train | Prepare every node" not in out, "a node was contacted"


def test_a_link_that_leaves_the_model_directory_is_refused_naming_it(tmp_path: Path) -> None:
    # Issue 45's probe: a link in a local model directory to a root-only 0600 file arrived on
    # every node as a 0644 file of the training account (rsync followed it).
    secret = tmp_path / "secret"
    secret.write_text("root's only\n")
    secret.chmod(0o600)
    model = _model(tmp_path)
    (model / "tokenizer.json").symlink_to(secret)
    dest = tmp_path / "dest"
    extra = [f"node_path={os.environ['PATH']}", f"model_source={model}", f"model_dest={dest}"]
    extra += [f"hub_cache_dir={tmp_path / 'hub'}"]
    out = _run_without_rsync(
        tmp_path,
        "tests/playbooks/stage_model.yml",
        *(arg for value in extra for arg in ("-e", value)),
        path=os.environ["PATH"],
    )
    assert f"{model}/tokenizer.json is a link to {secret}, outside {model}" in out, out[-2000:]
    assert not dest.exists(), "the model was copied"


def test_only_a_directorys_own_regular_files_may_be_staged(tmp_path: Path) -> None:
    model = _model(tmp_path)
    (model / "sub").mkdir()
    (model / "weights.safetensors").write_bytes(b"w")
    (model / "alias.json").symlink_to("config.json")  # inside: fine
    (model / "subdir").symlink_to("sub")
    assert model_stage_escapes(str(model)) == []
    # A snapshot of the Hugging Face cache links into its repo's blobs/: fine, and no further.
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("{}")
    snapshot = repo / "snapshots" / "0123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/abc")
    assert model_stage_escapes(str(snapshot)) == []
    (snapshot / "x").symlink_to(tmp_path / "model" / "config.json")
    os.mkfifo(model / "pipe")
    (model / "gone").symlink_to(model / "nothing")
    assert model_stage_escapes(str(snapshot)) == [
        f"{snapshot / 'x'} is a link to {model / 'config.json'}, outside {repo}"
    ]
    assert sorted(model_stage_escapes(str(model))) == [
        f"{model / 'gone'} is a link to {model / 'nothing'}, which does not exist",
        f"{model / 'pipe'} is neither a directory nor a regular file",
    ]
