#!/usr/bin/env python3
"""P2P between the GPUs of this node: for every ordered pair, whether CUDA reports peer access
and whether a tensor copied from one GPU to the other arrives intact (a broken P2P path, as on
some RTX 4090 drivers, reports access and corrupts or stalls the copy). Prints one JSON line;
plugins/filter/links.py's links_p2p decides NCCL_P2P_DISABLE from it. No GPU: {"gpus": 0}.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    """Probe every pair; print the result."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pairs = []
    for a in range(count):
        for b in range(count):
            if a == b:
                continue
            access = bool(torch.cuda.can_device_access_peer(a, b))
            sent = torch.arange(1 << 20, dtype=torch.int32, device=f"cuda:{a}")
            arrived = sent.to(f"cuda:{b}")
            torch.cuda.synchronize(b)
            intact = bool(torch.equal(arrived.cpu(), sent.cpu()))
            pairs.append({"from": a, "to": b, "access": access, "intact": intact})
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    print(json.dumps({"gpus": count, "names": names, "pairs": pairs}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
