"""Whether a node's checkpoint is its own ranks' alone (`sharded`, decided once, in the plan).
The checkpoint a continued run resumes from is llama-job's rule (llama_job/resume.py)."""

from __future__ import annotations

# A stage whose checkpoint holds, on each node, only that node's ranks' state (DeepSpeed's ZeRO
# partitions and its per-rank files; FSDP's sharded state): no node can stand in for another.
UNSHARDED_STAGES = frozenset({"none"})


def sharded_checkpoints(stage: str) -> bool:
    """Whether a run of this stage (the plan's `deepspeed`) writes checkpoints that are each
    node's own (the plan's `sharded`)."""
    return stage not in UNSHARDED_STAGES
