"""Print the versions of the node's training stack as JSON (the local fact llama_stack).

Run with the environment's python. Usage: stack_probe.py LLAMAFACTORY_CLI [CACHE]

The distributions' versions are read from their metadata on every run. What only importing torch
and running `llamafactory-cli env` tells (torch's CUDA and NCCL, LLaMA-Factory's report, half a
minute on a small node) is kept in the file CACHE, if given, with the key of everything it
depends on: every installed distribution and its version, the Python, the kernel, the NVIDIA
driver and GPUs. Any change to one of them probes again; the probe writes nothing else.
"""

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, distributions, version
from pathlib import Path
from types import ModuleType

DISTRIBUTIONS = (
    "torch",
    "torchaudio",
    "torchvision",
    "transformers",
    "llamafactory",
    "deepspeed",
    "accelerate",
    "peft",
)
# What a plan may need beyond the core: their version, or null where not installed (torchao an
# extra, llamafactory_extras; bitsandbytes and liger-kernel in the stack since issue 38, but a
# node provisioned before has neither: the planner then leaves the techniques that need them).
OPTIONAL = ("torchao", "bitsandbytes", "liger-kernel")
NVIDIA = Path("/proc/driver/nvidia")


def installed(name: str) -> str | None:
    """A distribution's version, None where it is not installed."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def probe_key(cli: str) -> str:
    """A digest of everything the expensive part of the probe depends on."""
    parts = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions())
    parts += [sys.executable, platform.python_version(), platform.platform(), cli]
    if NVIDIA.is_dir():
        files = [NVIDIA / "version", *sorted(NVIDIA.glob("gpus/*/information"))]
        parts += [f"{path}:{path.read_text(errors='replace')}" for path in files if path.is_file()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def nccl_version(torch: ModuleType) -> str | None:
    """The NCCL that torch bundles (the one training uses), or None without CUDA."""
    if not torch.cuda.is_available() and torch.version.cuda is None:
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


def runtime(cli: str) -> dict[str, object]:
    """torch's CUDA and NCCL, and LLaMA-Factory's own report (imports torch, runs the CLI)."""
    import torch  # noqa: PLC0415 - seconds to import: only when the cache does not answer

    env = subprocess.run([cli, "env"], capture_output=True, text=True, check=True, timeout=300)
    # Only the report's "- key: value" lines: log lines carry timestamps and would change each run.
    report = [line for line in env.stdout.splitlines() if line.startswith("- ")]
    return {
        "torch_cuda": torch.version.cuda,
        "nccl": nccl_version(torch),
        "llamafactory_env": "\n".join(report),
    }


def cached_runtime(cli: str, cache: Path | None) -> dict[str, object]:
    """runtime(cli), from the cache when its key still holds (then written back)."""
    if cache is None:
        return runtime(cli)
    key = probe_key(cli)
    try:
        saved = json.loads(cache.read_text())
        if saved.get("key") == key:
            return saved["runtime"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    found = runtime(cli)
    try:
        with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False) as tmp:
            json.dump({"key": key, "runtime": found}, tmp, sort_keys=True)
        os.replace(tmp.name, cache)
    except OSError:
        pass  # a cache that cannot be written only costs the next run its time
    return found


def main() -> None:
    """Print the fact."""
    cli = sys.argv[1]
    cache = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    stack: dict[str, object] = {"python": platform.python_version()}
    stack.update({name: version(name) for name in DISTRIBUTIONS})
    stack.update({name: installed(name) for name in OPTIONAL})
    stack.update(cached_runtime(cli, cache))
    print(json.dumps(stack, sort_keys=True))


if __name__ == "__main__":
    main()
