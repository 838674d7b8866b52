"""Generate the `tiny` model: a byte-level BPE tokenizer and a 2-layer Qwen2 with random weights.

Standard library only, so any controller can make it (no torch, tokenizers or transformers):
the files are the ones transformers reads (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json). Deterministic: the same arguments give the same bytes anywhere. The
directory appears complete or not at all (written beside it, then renamed). Prints a JSON
summary (path, parameter count, sha256 over the saved files) and writes it to
<dir>/tiny_model.json.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import struct
import sys
from collections import Counter
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD, EOS = "<|endoftext|>", "<|im_end|>"
TEXT = (
    "the cluster trains a tiny model on two nodes with gloo and every rank starts from the same "
    "weights capital city of france paris japan tokyo kenya nairobi add two numbers spell the word "
    "backwards translate to french gradient checkpoint optimizer network tokenizer llama factory "
    "ansible torch deepspeed learning rate batch epoch loss step user assistant system question "
    "answer thank you welcome good morning letters how many which is what are"
)
WORDS = TEXT.split()
# The pre-tokenizer of byte-level BPE (GPT-2's pattern, with \p{L} and \p{N} spelled for `re`).
PRE_TOKENIZER = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"
)
INIT_STD = 0.02
SUMMARY = "tiny_model.json"


def corpus(lines: int) -> list[str]:
    """A few hundred deterministic lines of text (a fixed-stride walk over WORDS, plus digits)."""
    out = []
    for i in range(lines):
        words = [WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(8 + i % 5)]
        out.append(f"{' '.join(words)} {i} + {i % 17} = {i + i % 17}.")
    return out


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map: every byte gets a printable character."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def train_bpe(lines: list[str], vocab_size: int) -> tuple[dict[str, int], list[list[str]]]:
    """Learn byte-level BPE merges until the vocabulary (specials + 256 bytes + merges) is full."""
    alphabet = byte_alphabet()
    words: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        for piece in PRE_TOKENIZER.findall(line):
            words[tuple(alphabet[b] for b in piece.encode())] += 1
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(alphabet.values()):
        vocab[char] = len(vocab)
    merges: list[list[str]] = []
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        # The most frequent pair; ties go to the smallest pair, so the result never varies.
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merged = best[0] + best[1]
        merges.append(list(best))
        vocab.setdefault(merged, len(vocab))
        words = Counter({merge_pair(word, best, merged): n for word, n in words.items()})
    return vocab, merges


def merge_pair(word: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    """The word with every occurrence of the pair replaced by the merged symbol."""
    out: list[str] = []
    i = 0
    while i < len(word):
        if word[i : i + 2] == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tokenizer_json(vocab: dict[str, int], merges: list[list[str]]) -> dict:
    """tokenizer.json as the tokenizers library writes it for a byte-level BPE."""
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab[token],
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for token in SPECIAL_TOKENS
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def model_config(vocab: dict[str, int], hidden: int) -> dict:
    """config.json of a 2-layer Qwen2ForCausalLM sized to the tokenizer."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(vocab),
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": vocab[EOS],
        "pad_token_id": vocab[PAD],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Name and shape of every weight Qwen2ForCausalLM saves (the head is tied to the embedding)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.q_proj.bias": (hidden,),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.k_proj.bias": (kv,),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.bias": (kv,),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (inner, hidden),
            prefix + "mlp.up_proj.weight": (inner, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inner),
        }
    return shapes


def initial_values(name: str, count: int, rng: random.Random) -> list[float]:
    """Qwen2's initialisation: norms 1, biases 0, every matrix N(0, initializer_range)."""
    if name.endswith("norm.weight"):
        return [1.0] * count
    if name.endswith(".bias"):
        return [0.0] * count
    return [rng.gauss(0.0, INIT_STD) for _ in range(count)]


def safetensors_bytes(shapes: dict[str, tuple[int, ...]], seed: int) -> tuple[bytes, int]:
    """The weights as a float32 safetensors file, and the number of parameters."""
    rng = random.Random(seed)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    total = 0
    for name in sorted(shapes):
        count = 1
        for dim in shapes[name]:
            count *= dim
        blob = struct.pack(f"<{count}f", *initial_values(name, count, rng))
        header[name] = {
            "dtype": "F32",
            "shape": list(shapes[name]),
            "data_offsets": [len(data), len(data) + len(blob)],
        }
        data += blob
        total += count
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + bytes(data), total


def checksum(directory: Path) -> str:
    """sha256 over the names and contents of the model's files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != SUMMARY:
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def write_model(directory: Path, vocab_size: int, hidden: int, lines: int, seed: int) -> dict:
    """Write every file of the model into directory and return its summary."""
    vocab, merges = train_bpe(corpus(lines), vocab_size)
    config = model_config(vocab, hidden)
    weights, parameters = safetensors_bytes(tensor_shapes(config), seed)
    files = {
        "config.json": json.dumps(config, indent=2) + "\n",
        "tokenizer.json": json.dumps(tokenizer_json(vocab, merges), ensure_ascii=False),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "pad_token": PAD,
                "additional_special_tokens": ["<|im_start|>"],
                "model_max_length": config["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n",
    }
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
    (directory / "model.safetensors").write_bytes(weights)
    summary = {
        "parameters": parameters,
        "vocab_size": len(vocab),
        "seed": seed,
        "sha256": checksum(directory),
    }
    (directory / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    """Build the model beside its directory, then move it into place and print its summary."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--lines", type=int, default=300)
    args = parser.parse_args()

    final = args.directory.absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(f".{final.name}.partial-{os.getpid()}")
    partial.mkdir()
    try:
        summary = write_model(partial, args.vocab_size, args.hidden, args.lines, args.seed)
        partial.rename(final)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not (final / SUMMARY).is_file():  # another run did not finish it first either
            raise
        summary = json.loads((final / SUMMARY).read_text())
    json.dump({"path": str(final), **summary}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
