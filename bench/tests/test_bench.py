"""The issue-17 benchmark's arithmetic (bench/gpu/analyse.py) and its carried-wheel checks.

No training here: the harness itself is proven by its CPU dry run (bench/README.md); these
pin the figures it reports to hand-computed values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
sys.path.insert(0, str(ROOT / "bench"))

import analyse  # noqa: E402
import baselines  # noqa: E402
import harness  # noqa: E402
import make_model  # noqa: E402
import wheels  # noqa: E402
from ansible_collections.llama.cluster.plugins.filter.cluster import cluster_ranks  # noqa: E402

# Qwen2.5-7B as bench/make_model.py writes bench_model.json for it (its published parameter count).
QWEN7B = {**make_model.SHAPES["7b"], "n_params": 7_615_616_512}


def log_lines(steps: int, step_s: float, tokens: int, compile_s: float) -> list[dict]:
    """A trainer_log.jsonl as LLaMA-Factory writes it: step s logged at compile + s * step_s."""
    out = []
    for s in range(1, steps + 1):
        seconds = compile_s + s * step_s
        out.append(
            {
                "current_steps": s,
                "total_steps": 1000,
                "loss": 12.0 - 0.01 * s,
                "total_tokens": s * tokens,
                "throughput": round(s * tokens / seconds, 2),
                "vram_allocated": 10.0 + (s == 3),
            }
        )
    return out


def test_window_excludes_compile_and_counts_tokens(tmp_path):
    path = tmp_path / "trainer_log.jsonl"
    records = log_lines(40, 0.25, 8000, compile_s=80.0)
    # A partial last line (the log is read while it is written) is skipped.
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"current_st')
    read = analyse.read_log(path)
    assert len(read) == 40
    m = analyse.run_metrics(read, warmup=10)
    assert m["tokens_per_s"] == pytest.approx(32000, rel=1e-4)
    assert m["step_s"] == pytest.approx(0.25, rel=1e-4)
    assert m["tokens_per_step"] == 8000
    assert m["first_steps_extra_s"] == pytest.approx(80.0, abs=0.1)
    assert m["peak_alloc_gib"] == 11.0
    assert analyse.window_done(read, 10, 20, 5.0)
    assert not analyse.window_done(read, 10, 31, 5.0)


def test_flops_full_tied_and_lora_untied():
    tied = {"n_params": 1_543_714_304, "vocab": 151936, "hidden": 1536, "tied": 1}
    assert analyse.flops_per_token(tied, "full")["flops"] == 6 * 1_543_714_304
    lora = analyse.flops_per_token(QWEN7B, "lora", 8)
    # The untied input embedding is a lookup, not a matrix product.
    assert lora["n_matmul"] == 7_615_616_512 - 152064 * 3584
    # Rank 8 on q, k, v, o, gate, up, down of 28 layers (k/v project to 4 KV heads of 128).
    per_layer = 8 * ((2 * 3584) + 2 * (3584 + 512) + (3584 + 3584) + 3 * (3584 + 18944))
    assert lora["n_lora"] == 28 * per_layer == 20_185_088
    assert lora["flops"] == 4 * lora["n_matmul"] + 6 * lora["n_lora"]
    # 12 L h c: a packed row of 2049 tokens attends to (2049 + 1) / 2 keys on average.
    assert analyse.attention_flops(QWEN7B, 1025) == 12 * 28 * 3584 * 1025
    assert analyse.mean_context_unpacked([1, 3]) == pytest.approx((1 + 6) / 4)
    assert analyse.mfu(6e9, 10000, 1) == pytest.approx(6e13 / 989e12)


def test_loss_comparison_within_and_outside_noise():
    base = [[s, 10.0 - 0.01 * s + (0.05 if s % 2 else -0.05)] for s in range(1, 41)]
    same = [[s, v + 0.001] for s, v in base]
    shifted = [[s, v + 0.5] for s, v in base]
    close = analyse.compare_losses(same, base, 6)
    assert close["within_noise"] is True
    assert close["steps"] == 35
    far = analyse.compare_losses(shifted, base, 6)
    assert far["within_noise"] is False
    assert far["mean_diff"] == pytest.approx(0.5)


def test_trace_summary_busy_fraction_and_classes(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#6", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 100, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 350, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel", "ts": 600, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 800, "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90, "dur": 20},
    ]
    trace = tmp_path / "t.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    s = analyse.trace_summary(trace)
    # Busy: 100-450 (the overlapping kernels once), 600-700, 800-850 = 500 of 1000 us.
    assert s["gpu_busy_fraction"] == 0.5
    assert s["by_class_ms"] == {
        "GEMM": 0.3,
        "triton (compiled)": 0.1,
        "optimizer": 0.1,
        "memcpy/memset": 0.05,
    }
    assert s["top_cpu_ops"][0]["name"] == "aten::mm"
    assert "| GEMM | 0.3 |" in analyse.trace_markdown(s)


def test_inventory_one_node_per_gpu():
    inv = harness.inventory("gpu", 2, Path("/opt/llama-cluster"), Path("/opt/torch/.venv"), None)
    cluster = inv["all"]["children"]["cluster"]["children"]
    hosts = {**cluster["master"]["hosts"], **cluster["workers"]["hosts"]}
    groups = {
        "cluster": list(hosts),
        "master": list(cluster["master"]["hosts"]),
        "workers": ["gpu1"],
    }
    assert cluster_ranks(groups, hosts) == {"gpu0": 0, "gpu1": 1}
    assert [h["gpu_ids"] for h in hosts.values()] == [[0], [1]]
    assert all(h["cluster_environment"]["NCCL_NVLS_ENABLE"] == "0" for h in hosts.values())
    # Left to the node facts unless asked for.
    assert "gpu_memory_gib" not in hosts["gpu0"]
    capped = harness.inventory(
        "gpu", 1, Path("/b"), Path("/e"), 24.0, extra_env={"LLAMA_BENCH_GPU_CAP_GIB": "24.0"}
    )
    node = capped["all"]["children"]["cluster"]["children"]["master"]["hosts"]["gpu0"]
    assert node["gpu_memory_gib"] == 24.0
    assert node["cluster_environment"]["LLAMA_BENCH_GPU_CAP_GIB"] == "24.0"
    assert node["cluster_environment"]["NCCL_NVLS_ENABLE"] == "0"


def test_expert_variants_pack_one_optimizer_step_into_rows():
    variants = baselines.expert_variants(8192, 2048)
    assert {v["per_device_train_batch_size"] for v in variants.values()} == {4}
    assert all(v["packing"] for v in variants.values())
    assert variants["c3_packed_nockpt_compile"]["torch_compile"] is True
    assert "disable_gradient_checkpointing" not in variants["c1_packed"]


def test_baseline_ratios_take_the_best_expert_config():
    runs = {
        "d_train_yml": {"ok": True, "tokens_per_s": 30000.0},
        "a_example": {"ok": True, "tokens_per_s": 1500.0},
        "b_example_batch": {"ok": True, "tokens_per_s": 6000.0},
        "c1_packed": {"ok": True, "tokens_per_s": 20000.0},
        "c2_packed_nockpt": {"ok": True, "tokens_per_s": 31000.0},
        "c3_packed_nockpt_compile": {"ok": False, "cause": "CUDA out of memory"},
    }
    summary = baselines.summarise("1.5b", baselines.GOALS["1.5b"], runs)
    assert summary["c_best"] == "c2_packed_nockpt"
    assert summary["d_over_a"] == 20.0
    assert summary["d_over_b"] == 5.0
    assert summary["d_over_c"] == pytest.approx(30000 / 31000, abs=1e-3)
    assert baselines.out_of_memory(
        {"ok": False, "cause": "torch.OutOfMemoryError: CUDA out of memory"}
    )
    assert not baselines.out_of_memory({"ok": True})


def test_gpu_cap_is_written_for_every_training_process(tmp_path):
    ctx = type("Ctx", (), {"work": tmp_path, "extra_env": {}, "gpu_memory_gib": None})()
    baselines.cap_gpu(ctx, 24.0)
    assert ctx.gpu_memory_gib == 24.0
    assert ctx.extra_env["LLAMA_BENCH_GPU_CAP_GIB"] == "24.0"
    code = (Path(ctx.extra_env["PYTHONPATH"]) / "sitecustomize.py").read_text()
    compile(code, "sitecustomize.py", "exec")
    assert "set_per_process_memory_fraction" in code
    assert "LOCAL_RANK" in code


def test_carried_wheels_must_be_for_python_312():
    assert wheels.installable(Path("multiprocess-0.70.16-py312-none-any.whl"))
    assert not wheels.installable(Path("multiprocess-0.70.16-py311-none-any.whl"))
    assert wheels.installable(Path("tokenizers-0.22.2-cp39-abi3-manylinux_2_17_x86_64.whl"))
    assert not wheels.installable(
        Path("pydantic_core-2.41.4-cp311-cp311-manylinux_2_17_x86_64.whl")
    )
    assert wheels.installable(Path("transformers-5.6.0-py3-none-any.whl"))


def test_packed_filler_is_taken_out_of_the_token_count(tmp_path):
    # 1000 samples of 400 tokens, 3 epochs of 100 optimizer steps: 4000 real tokens a step; the
    # log counted 4100 (the filler of packed rows has an attention mask of 1).
    (tmp_path / "train.yaml").write_text("packing: true\nnum_train_epochs: 3.0\n")
    (tmp_path / "trainer_log.jsonl").write_text(
        json.dumps({"current_steps": 1, "total_steps": 300})
    )
    result = {"tokens_per_s": 41000.0, "tokens_per_step": 4100.0}
    harness.real_tokens(result, tmp_path, [400] * 1000)
    assert result["tokens_per_step"] == 4000
    assert result["tokens_per_s"] == pytest.approx(40000, rel=1e-6)
    assert result["filler_fraction"] == pytest.approx(0.0244, abs=1e-4)
    unpacked = {"tokens_per_s": 1.0, "tokens_per_step": 1.0}
    (tmp_path / "train.yaml").write_text("packing: false\n")
    harness.real_tokens(unpacked, tmp_path, [400])
    assert unpacked == {"tokens_per_s": 1.0, "tokens_per_step": 1.0}


def test_gpu_memory_leaves_out_the_model_generators(monkeypatch):
    rows = {
        "--query-gpu=index,memory.used": [["0", "50000"], ["1", "700"]],
        "--query-gpu=index,uuid": [["0", "GPU-a"], ["1", "GPU-b"]],
        "--query-compute-apps=gpu_uuid,pid,used_memory": [
            ["GPU-a", "123", "45000"],
            ["GPU-a", "9", "5000"],
        ],
    }
    monkeypatch.setattr(harness, "smi", lambda query: rows[query])
    assert harness.gpu_used_mib(set()) == {0: 50000, 1: 700}
    assert harness.gpu_used_mib({123}) == {0: 5000, 1: 700}


def test_root_cause_skips_the_launchers_wrappers():
    log = "\n".join(
        [
            "Traceback (most recent call last):",
            "deepspeed.runtime.zero.utils.ZeRORuntimeException: You are using ZeRO-Offload with",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "subprocess.CalledProcessError: Command '['torchrun']' returned non-zero exit status",
        ]
    )
    assert analyse.root_cause(log).startswith(
        "deepspeed.runtime.zero.utils.ZeRORuntimeException: You"
    )
    assert analyse.root_cause("ChildFailedError: x").startswith("ChildFailedError")
    assert analyse.root_cause("all fine") == ""
    ranked = "[rank0]: RuntimeError: There are currently no available devices found"
    assert analyse.root_cause(f"x\n{ranked}\nChildFailedError: ") == ranked


def test_a_cards_phase_names_its_cap_and_a_goal_with_hand_configs_of_its_kind():
    assert baselines.parse_phase("cards24-1.5bfull") == ("cards", "1.5bfull", 24.0)
    assert baselines.parse_phase("cards48-14blora") == ("cards", "14blora", 48.0)
    for key in ("1.5bfull", "14blora"):
        assert baselines.CARD_VARIANTS[baselines.GOALS[key].finetuning]
    with pytest.raises(SystemExit, match="cards<GiB>-<goal>"):
        baselines.parse_phase("cards24-nope")


def test_the_cards_models_have_shapes_to_generate():
    assert {"1.5b", "14b"} <= set(make_model.SHAPES)


def test_slimming_bitsandbytes_keeps_one_cuda_library_and_a_consistent_record(tmp_path):
    import zipfile  # noqa: PLC0415

    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    libs = ["libbitsandbytes_cuda118.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so"]
    with zipfile.ZipFile(wheel, "w") as whl:
        for name in ["__init__.py", *libs]:
            whl.writestr(f"bitsandbytes/{name}", b"x")
        record = "".join(f"bitsandbytes/{n},sha256=x,1\n" for n in ["__init__.py", *libs])
        whl.writestr("bitsandbytes-0.50.2.dist-info/RECORD", record)
    wheels.slim_bitsandbytes(wheel)
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        record = whl.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert "bitsandbytes/libbitsandbytes_cuda118.so" not in names
    assert {"bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/__init__.py"} <= names
    assert "cuda118" not in record
    assert "cuda130" in record
