"""Print the versions of the node's training stack as JSON (the local fact llama_stack).

Run with the environment's python; read-only. Usage: stack_probe.py LLAMAFACTORY_CLI
"""

import json
import platform
import subprocess
import sys
from importlib.metadata import version

import torch

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


def nccl_version() -> str | None:
    """The NCCL that torch bundles (the one training uses), or None without CUDA."""
    if not torch.cuda.is_available() and torch.version.cuda is None:
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return None


def main() -> None:
    """Print the fact."""
    stack: dict[str, object] = {"python": platform.python_version()}
    stack.update({name: version(name) for name in DISTRIBUTIONS})
    stack["torch_cuda"] = torch.version.cuda
    stack["nccl"] = nccl_version()
    env = subprocess.run(
        [sys.argv[1], "env"], capture_output=True, text=True, check=True, timeout=300
    )
    # Only the report's "- key: value" lines: log lines carry timestamps and would change each run.
    report = [line for line in env.stdout.splitlines() if line.startswith("- ")]
    stack["llamafactory_env"] = "\n".join(report)
    print(json.dumps(stack, sort_keys=True))


if __name__ == "__main__":
    main()
