"""Filters for the preflight: compare what every node reports and say which node is odd."""

from __future__ import annotations

from collections import Counter
from typing import Any

MISSING = "-"


def _text(value: Any) -> str:  # noqa: ANN401 - facts are arbitrary JSON
    """One cell of the table: lists of GPUs become their distinct model names, the OS its key."""
    if value is None or value == "":
        return MISSING
    if isinstance(value, dict):
        for field in ("name", "key", "model", "version"):
            if field in value:
                return _text(value[field])
        return ",".join(f"{k}={_text(v)}" for k, v in sorted(value.items()))
    if isinstance(value, list | tuple):
        names = sorted({_text(item) for item in value})
        return "+".join(names) if names else MISSING
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).strip()


def _value(facts: dict[str, Any], key: dict[str, Any]) -> str:
    """One cell: the fact's key, or with `field` that field of each item of a list (the memory
    of every GPU)."""
    value = (facts.get(key["fact"]) or {}).get(key["key"])
    field = key.get("field")
    if field and isinstance(value, list):
        value = [item.get(field) if isinstance(item, dict) else item for item in value]
    return _text(value)


def preflight_consistency(
    local_facts: dict[str, dict[str, Any]],
    keys: list[dict[str, Any]],
    reference: str,
    allow_hardware: bool = False,
) -> dict[str, Any]:
    """Compare the local facts of every node.

    local_facts maps a host to its ansible_local; keys lists {name, fact, key, field?,
    hardware?}; reference is the host whose value wins a tie (the master). Returns missing
    (host: facts it lacks), rows, a printable table and one message per odd value: in
    mismatches (refused), or in reported for a hardware key (GPU model, memory, count, driver)
    when allow_hardware is set.
    """
    facts_needed = sorted({key["fact"] for key in keys})
    missing = {
        host: [fact for fact in facts_needed if not isinstance(facts.get(fact), dict)]
        for host, facts in local_facts.items()
    }
    missing = {host: facts for host, facts in missing.items() if facts}

    hosts = list(local_facts)
    rows = {host: {key["name"]: _value(local_facts[host], key) for key in keys} for host in hosts}

    mismatches: list[str] = []
    reported: list[str] = []
    for key in keys:
        name = key["name"]
        values = {host: rows[host][name] for host in hosts}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        leaders = [value for value, count in counts.items() if count == top]
        usual = values.get(reference) if values.get(reference) in leaders else leaders[0]
        agreeing = sorted(host for host, value in values.items() if value == usual)
        odd = reported if allow_hardware and key.get("hardware") else mismatches
        for host in hosts:
            if values[host] != usual:
                odd.append(
                    f"{host}: {name} is {values[host]}, but {usual} on {', '.join(agreeing)}"
                )

    return {
        "missing": missing,
        "rows": rows,
        "table": _table(hosts, [key["name"] for key in keys], rows),
        "mismatches": mismatches,
        "reported": reported,
    }


def _table(hosts: list[str], names: list[str], rows: dict[str, dict[str, str]]) -> list[str]:
    """Lines of a fixed-width table: one row per node, one column per checked value."""
    header = ["node", *names]
    body = [[host, *(rows[host][name] for name in names)] for host in hosts]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *body]
    ]


def preflight_gpu_ids(gpu_ids: dict[str, Any], local_facts: dict[str, dict[str, Any]]) -> list[str]:
    """One message per node whose inventory gpu_ids name GPUs it does not have.

    gpu_ids maps a host to its gpu_ids (None or "": every GPU it has); local_facts maps a host
    to its ansible_local, whose llama_host.gpus lists the GPUs with their index.
    """
    problems = []
    for host, wanted in gpu_ids.items():
        if wanted is None or wanted == "":
            continue
        gpus = ((local_facts.get(host) or {}).get("llama_host") or {}).get("gpus") or []
        have = sorted(
            {int(gpu["index"]) for gpu in gpus if isinstance(gpu, dict) and "index" in gpu}
        )
        asked = wanted if isinstance(wanted, list | tuple) else [wanted]
        absent = [gpu for gpu in asked if _index(gpu) not in have]
        if absent:
            has = f"it has {', '.join(map(str, have))}" if have else "it has no GPUs"
            problems.append(
                f"{host}: gpu_ids {list(asked)} name {', '.join(map(str, absent))}, which "
                f"{host} does not have ({has}, in ansible_local.llama_host.gpus)"
            )
    return problems


def _index(value: Any) -> int | None:  # noqa: ANN401 - an inventory value
    """A GPU index as an int, or None when the value is not one."""
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class FilterModule:
    """The preflight's filters."""

    def filters(self) -> dict[str, Any]:
        """Map filter names to functions."""
        return {
            "preflight_consistency": preflight_consistency,
            "preflight_gpu_ids": preflight_gpu_ids,
        }
