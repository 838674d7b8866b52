"""Generate the `tiny` model: a byte-level BPE tokenizer and a 2-layer Qwen2 with random weights.

Deterministic: the same versions of torch, tokenizers and transformers give the same bytes on
every node, so every rank starts from the same weights. Prints a JSON summary (path, parameter
count, sha256 over the saved files) and writes it to <dir>/tiny_model.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = (
    "the cluster trains a tiny model on two nodes with gloo and every rank starts from the same "
    "weights capital city of france paris japan tokyo kenya nairobi add two numbers spell the word "
    "backwards translate to french gradient checkpoint optimizer network tokenizer llama factory "
    "ansible torch deepspeed learning rate batch epoch loss step user assistant system question "
    "answer thank you welcome good morning letters how many which is what are"
)
WORDS = TEXT.split()


def corpus(lines: int) -> list[str]:
    """A few hundred deterministic lines of text (a fixed-stride walk over WORDS, plus digits)."""
    out = []
    for i in range(lines):
        words = [WORDS[(i * 7 + j * 13) % len(WORDS)] for j in range(8 + i % 5)]
        out.append(f"{' '.join(words)} {i} + {i % 17} = {i + i % 17}.")
    return out


def build_tokenizer(vocab_size: int, lines: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it as a transformers tokenizer."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(lines), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


def build_model(tokenizer: PreTrainedTokenizerFast, hidden: int, seed: int) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 sized to the tokenizer, initialised from a fixed seed."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    return Qwen2ForCausalLM(config)


def checksum(directory: Path) -> str:
    """sha256 over the names and contents of the model's files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != "tiny_model.json":
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def main() -> None:
    """Build and save the model, then print and record its summary."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--vocab-size", type=int, default=400)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--lines", type=int, default=300)
    args = parser.parse_args()

    tokenizer = build_tokenizer(args.vocab_size, args.lines)
    model = build_model(tokenizer, args.hidden, args.seed)
    args.directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.directory)
    model.save_pretrained(args.directory, safe_serialization=True)
    summary = {
        "path": str(args.directory),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "seed": args.seed,
        "sha256": checksum(args.directory),
    }
    (args.directory / "tiny_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
