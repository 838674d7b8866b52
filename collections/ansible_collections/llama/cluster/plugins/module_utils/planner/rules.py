"""Profile rules, kept as data in group_vars/all/training.yml: `when` (every condition holds)
-> `set` (training arguments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import TRAINING_FILE, PlanError

RULE_EQUAL_KEYS = ("accelerator", "finetuning_type", "deepspeed", "model", "stage")
RULE_RANGE_KEYS = ("params_b", "world_size", "nnodes", "gpu_memory_gib", "cutoff_len")
RULE_KEYS = RULE_EQUAL_KEYS + tuple(
    f"{side}_{key}" for key in RULE_RANGE_KEYS for side in ("min", "max")
)


def check_rules(rules: Any) -> list[Mapping[str, Any]]:  # noqa: ANN401 - user data
    """The rules, or a PlanError naming the rule and the key that cannot be tested."""
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise PlanError(f"training_profile_rules ({TRAINING_FILE}) must be a list of rules.")
    for index, rule in enumerate(rules):
        name = rule.get("name", f"#{index + 1}") if isinstance(rule, Mapping) else f"#{index + 1}"
        if (
            not isinstance(rule, Mapping)
            or not isinstance(rule.get("when") or {}, Mapping)
            or not isinstance(rule.get("set"), Mapping)
        ):
            raise PlanError(
                f"Profile rule {name} ({TRAINING_FILE}): needs a `set` mapping (and a `when` "
                "mapping, or none to always apply)."
            )
        unknown = [k for k in rule.get("when") or {} if k not in RULE_KEYS]
        if unknown:
            raise PlanError(
                f"Profile rule {name!r} ({TRAINING_FILE}) tests {', '.join(unknown)}, which no "
                f"rule can test. Keys a rule can test: {', '.join(RULE_KEYS)}."
            )
    return list(rules)


def rule_matches(rule: Mapping[str, Any], facts: Mapping[str, Any]) -> bool:
    """Whether every condition of the rule's `when` holds for these facts.

    An equality key matches one value or any of a list; min_<x>/max_<x> bound a number and
    never match a fact that is unknown (gpu_memory_gib on a CPU cluster).
    """
    for key, wanted in (rule.get("when") or {}).items():
        if key in RULE_EQUAL_KEYS:
            if facts.get(key) not in (wanted if isinstance(wanted, list) else [wanted]):
                return False
            continue
        side, name = key.split("_", 1)
        value = facts.get(name)
        if value is None or (side == "min" and value < float(wanted)):
            return False
        if side == "max" and value > float(wanted):
            return False
    return True


def apply_rules(
    rules: Sequence[Mapping[str, Any]], facts: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """The settings of every matching rule (later rules win), and the names that matched."""
    settings: dict[str, Any] = {}
    names = []
    for rule in rules:
        if rule_matches(rule, facts):
            settings.update(rule["set"])
            names.append(str(rule.get("name", "")))
    return settings, names
