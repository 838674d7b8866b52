"""Tokenize a run's datasets once on this node, before its ranks start (tokenized_path).

    <env>/bin/python pretokenize.py RUN/train.yaml --cache-dir DIR [--keep N] [--log FILE]

Runs in the training environment, as the training user. Reads the run's train.yaml; where it
sets tokenized_path, that path becomes a link to DIR/<key>, a copy that LLaMA-Factory's own
preprocessing wrote (get_dataset with tokenized_path, as its training entry point calls it), so
that every rank loads the tokenized datasets from disk instead of tokenizing them while the
collective timeout runs. The key is a digest of what the tokens depend on: the content of the
dataset files and their dataset_info.json entries, the tokenizer's files, every data and model
argument in train.yaml (template, cutoff_len, packing, ...), the training stage and seed, and
the versions of LLaMA-Factory, transformers, tokenizers and datasets. A second run with the same
key reuses the copy; a changed dataset, tokenizer or argument makes a new one. The copy is made
under a temporary name and renamed when complete; the oldest copies beyond --keep are removed.
Prints one JSON line: {"action": "tokenized" | "reused" | "none", "key", "path", "seconds",
"records", "dataset_bytes"}; LLaMA-Factory's own output goes to --log.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

# Arguments of train.yaml that change how the work is done or where its files are, not the
# tokens; and those only training reads. Every other argument is in the key: one this list
# does not know makes a new copy when it changes, never a stale one.
NOT_IN_KEY = {
    "tokenized_path", "dataset_dir", "media_dir", "output_dir", "cache_dir",
    "preprocessing_num_workers", "preprocessing_batch_size", "overwrite_cache",
    "data_shared_file_system", "dataloader_num_workers",
}  # fmt: skip
TRAINING_ONLY = {
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_ratio", "warmup_steps",
    "weight_decay", "bf16", "fp16", "pure_bf16", "ddp_timeout", "resume_from_checkpoint",
    "logging_steps", "save_steps", "save_total_limit", "save_on_each_node", "save_only_model",
    "plot_loss", "overwrite_output_dir", "report_to", "run_name", "deepspeed", "fsdp",
    "fsdp_config", "disable_gradient_checkpointing", "ddp_find_unused_parameters",
    "torch_compile", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "flash_attn",
}  # fmt: skip
# Training arguments the preprocessing reads (the stage picks the processor; the seed shuffles
# and splits).
TRAINING_KEYS = ("stage", "do_train", "do_eval", "do_predict", "seed", "finetuning_type")
PACKAGES = ("llamafactory", "transformers", "tokenizers", "datasets")
TOKENIZER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    """sha256 of a file's content, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def preprocessing_args(train: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The arguments of train.yaml that LLaMA-Factory's preprocessing reads: those in `names`
    (every data and model argument) and the training arguments it needs (TRAINING_KEYS)."""
    return {k: v for k, v in train.items() if k in names or k in TRAINING_KEYS}


def used_datasets(args: dict[str, Any]) -> list[str]:
    """The dataset names train.yaml trains and evaluates on."""
    names: list[str] = []
    for key in ("dataset", "eval_dataset"):
        value = args.get(key) or []
        names += [n.strip() for n in value.split(",")] if isinstance(value, str) else list(value)
    return [n for n in names if n]


def cache_key(args: dict[str, Any]) -> tuple[str, int]:
    """The digest of everything the tokenized copy depends on, and the datasets' bytes.

    Reads files and package metadata only (no import of LLaMA-Factory): a reuse takes a
    fraction of a second plus reading the datasets once.
    """
    dataset_dir = Path(args.get("dataset_dir") or "data")
    info_file = dataset_dir / "dataset_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    files, size = {}, 0
    for name in used_datasets(args):
        entry = info.get(name, {})
        local = dataset_dir / entry.get("file_name", name)
        paths = sorted(local.rglob("*")) if local.is_dir() else [local]
        for path in paths:
            if path.is_file():
                files[str(path.relative_to(dataset_dir))] = file_digest(path)
                size += path.stat().st_size
    model = Path(str(args.get("model_name_or_path", "")))
    tokenizer = {n: file_digest(model / n) for n in TOKENIZER_FILES if (model / n).is_file()}
    inputs = {
        "arguments": {k: v for k, v in args.items() if k not in NOT_IN_KEY | TRAINING_ONLY},
        "datasets": {name: info.get(name) for name in used_datasets(args)},
        "files": files,
        "tokenizer": tokenizer if model.is_dir() else str(model),
        "versions": {name: metadata.version(name) for name in PACKAGES},
    }
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], size


def tokenize(train: dict[str, Any], destination: Path, scratch: Path) -> dict[str, int]:
    """LLaMA-Factory's preprocessing of the run's datasets, saved to `destination`: records per
    split. One process, no GPU; the training arguments that only training reads are left out."""
    # datasets' own cache (the files as Arrow, each map step's output) goes to the scratch
    # directory, removed afterwards: the saved copy is what stays on the node. It is read when
    # datasets is imported, so LLaMA-Factory (and torch, seconds to import) is imported here,
    # which also keeps a reuse of a copy free of it.
    os.environ["HF_DATASETS_CACHE"] = str(scratch / "datasets")
    from llamafactory import data, hparams, model  # noqa: PLC0415 - after HF_DATASETS_CACHE

    fields = (hparams.DataArguments, hparams.ModelArguments)
    args = preprocessing_args(train, {f.name for c in fields for f in dataclasses.fields(c)})
    run = {**args, "tokenized_path": str(destination), "output_dir": str(scratch / "output")}
    run.update({"report_to": "none", "overwrite_output_dir": True})
    model_args, data_args, training_args, finetuning_args, _ = hparams.get_train_args(run)
    tokenizer_module = model.load_tokenizer(model_args)
    template = data.get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    module = data.get_dataset(
        template, model_args, data_args, training_args, finetuning_args.stage, **tokenizer_module
    )
    return {
        k: len(v) for k, v in module.items() if not isinstance(v, dict) and hasattr(v, "__len__")
    }


def make_copy(train: dict[str, Any], target: Path, size: int, log: Path | None) -> dict[str, int]:
    """Tokenize into a temporary directory beside `target`, then rename it: records per split.
    LLaMA-Factory's output goes to `log` (stdout and stderr, the progress bars included)."""
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    scratch = target.with_name(f".{target.name}.{os.getpid()}.scratch")
    started = time.monotonic()
    out, err = os.dup(1), os.dup(2)
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    with (log or Path(os.devnull)).open("ab") as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        try:
            records = tokenize(train, partial, scratch)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(out, 1)
            os.dup2(err, 2)
            shutil.rmtree(scratch, ignore_errors=True)
    try:
        os.rename(partial, target)
    except OSError:  # another node of shared storage finished first: its copy is the same
        shutil.rmtree(partial, ignore_errors=True)
    seconds = round(time.monotonic() - started, 1)
    info = {"records": records, "seconds": seconds, "dataset_bytes": size, "made": time.time()}
    target.with_suffix(".json").write_text(json.dumps(info) + "\n")
    return records


def replace_link(link: Path, target: Path) -> None:
    """Point `link` at `target`, atomically; a directory at `link` is refused (never removed)."""
    if link.exists() and not link.is_symlink():
        raise SystemExit(f"{link} exists and is not a link: move it away to pretokenize this run")
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)


def prune(cache: Path, keep: int, current: Path) -> list[str]:
    """Remove the least recently used copies beyond `keep` (never `current`); their names."""
    copies = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    copies.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    for old in [p for p in copies if p != current][max(keep - 1, 0) :]:
        shutil.rmtree(old, ignore_errors=True)
        old.with_suffix(".json").unlink(missing_ok=True)
        removed.append(old.name)
    return removed


def summary(result: dict[str, Any]) -> str:
    """What was done, in words: the datasets' size, the rows and the time."""
    rows = sum((result.get("records") or {}).values())
    size, unit = float(result["dataset_bytes"]), "bytes"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, name
    size = f"{size:.2f} {unit}" if unit != "bytes" else f"{int(size)} bytes"
    if result["action"] == "reused":
        return (
            f"reused the tokenized copy {result['key']} of {size} of datasets ({rows:,} rows) "
            f"in {result['seconds']} s"
        )
    return (
        f"tokenized {size} of datasets into {rows:,} rows in {result['seconds']} s "
        f"(copy {result['key']}, which later runs of the same data reuse)"
    )


def main(argv: list[str] | None = None) -> int:
    """Make or reuse this node's tokenized copy of a run's datasets; print what was done."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_yaml", type=Path)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--log", type=Path)
    options = parser.parse_args(argv)
    train = yaml.safe_load(options.train_yaml.read_text()) or {}
    if not train.get("tokenized_path"):
        said = "train.yaml sets no tokenized_path: the ranks tokenize the datasets themselves"
        print(json.dumps({"action": "none", "summary": said}))
        return 0
    started = time.monotonic()
    link = Path(train["tokenized_path"])
    key, size = cache_key(train)
    cache = options.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / key
    result: dict[str, Any] = {"key": key, "path": str(target), "dataset_bytes": size}
    if target.is_dir() and any(target.iterdir()):
        os.utime(target)  # recently used: prune keeps it
        result["action"] = "reused"
        made = target.with_suffix(".json")
        result["records"] = json.loads(made.read_text()).get("records") if made.is_file() else None
    else:
        result["action"] = "tokenized"
        result["records"] = make_copy(train, target, size, options.log)
    replace_link(link, target)
    result["removed"] = prune(cache, options.keep, target)
    result["seconds"] = round(time.monotonic() - started, 1)
    result["summary"] = summary(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
