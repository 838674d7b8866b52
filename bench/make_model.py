"""Generate a random-initialised Qwen2.5-shaped model, its tokenizer and a synthetic alpaca set.

Nothing comes from a hub. The model has the exact shape of Qwen2.5-0.5B, -1.5B, -3B or -7B (hidden
size, layers, heads, KV heads, intermediate size, tied or untied embeddings, RoPE theta) and that
model's padded vocabulary (151936 rows; 152064 for 7B), so parameter count, lm_head FLOPs and
memory match the real models. The tokenizer is the tiny model's byte-level BPE
(scripts/make_tiny_model.py, imported, not copied) trained on the synthetic corpus
(16384 entries plus the Qwen chat special tokens), so only the first ~16k rows of the embedding are
ever looked up; the softmax still runs over all the logits, as it does for the real model.

The dataset is deterministic (seeded) alpaca JSON with realistic, long-tailed lengths: a log-normal
response length (median 75 words). With the qwen template and this tokenizer a sample has 347 tokens
on average (median 275, p90 633, p99 1424); 2.6 % are longer than the 1024-token cutoff. Batches of
8 padded to their longest sample are ~50 % padding, so padding, truncation and packing behave as on
real instruction data.

Usage::

    python3 bench/make_model.py --size 0.5b --out /tmp/models/qwen2.5-0.5b-random \
        --data-dir /tmp/bench-data --samples 12000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

SEED = 1234
TOKENIZER_VOCAB = 16384
MODEL_VOCAB = 151936
DATASET_NAME = "synth_alpaca"
# The tiny model's generator: its tokenizer builder is the one this benchmark uses.
TINY_MODEL_SCRIPT = Path(__file__).resolve().parents[1] / "scripts/make_tiny_model.py"

# Shapes from the published Qwen2.5 config.json files (hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, tie_word_embeddings):
# up to 3B the embedding is tied to the lm_head; 7B has its own lm_head and 128 more vocab rows.
SHAPES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864},
    "1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960},
    "3b": {"hidden": 2048, "layers": 36, "heads": 16, "kv_heads": 2, "intermediate": 11008},
    "7b": {
        "hidden": 3584,
        "layers": 28,
        "heads": 28,
        "kv_heads": 4,
        "intermediate": 18944,
        "vocab": 152064,
        "tied": 0,
    },
    # Qwen3-8B's dimensions (the catalogue's qwen3-8b) in Qwen2's architecture (no q/k norms,
    # 0.01 % of the weights): the 8B LoRA on a 24 GiB card (issue 46).
    "8b": {
        "hidden": 4096,
        "layers": 36,
        "heads": 32,
        "kv_heads": 8,
        "intermediate": 12288,
        "vocab": 151936,
        "tied": 0,
    },
    # Qwen2.5-14B: a 14B-class model for QLoRA on a 24 GiB card (issue 38).
    "14b": {
        "hidden": 5120,
        "layers": 48,
        "heads": 40,
        "kv_heads": 8,
        "intermediate": 13824,
        "vocab": 152064,
        "tied": 0,
    },
    # A few thousand parameters: for CPU smoke tests of the bench scripts only.
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128},
}

_SYLLABLES = [
    c + v
    for c in ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
    for v in ["a", "e", "i", "o", "u", "ai", "ou", "en", "ar", "is"]
]


def _lexicon(rng: random.Random, size: int = 6000) -> list[str]:
    """Return `size` distinct pseudo-words of one to four syllables."""
    words: set[str] = set()
    while len(words) < size:
        n = rng.choices([1, 2, 3, 4], weights=[2, 5, 3, 1])[0]
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    return sorted(words)


class _Writer:
    """Draw Zipf-distributed words with some sentence structure."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.words = _lexicon(rng)
        weights = [1.0 / (rank + 2.7) for rank in range(len(self.words))]
        total = 0.0
        self.cum: list[float] = []
        for w in weights:
            total += w
            self.cum.append(total)

    def text(self, n_words: int) -> str:
        """Return about `n_words` words split into sentences and paragraphs."""
        words = self.rng.choices(self.words, cum_weights=self.cum, k=max(1, n_words))
        out: list[str] = []
        sentence_left = self.rng.randint(6, 18)
        for i, word in enumerate(words):
            out.append(word.capitalize() if sentence_left in (0, 18) or i == 0 else word)
            sentence_left -= 1
            if sentence_left <= 0:
                out[-1] += self.rng.choice([".", ".", ".", "?", "!", ":"])
                if self.rng.random() < 0.15:
                    out[-1] += "\n\n" + f"{self.rng.randint(1, 9)}."
                sentence_left = self.rng.randint(6, 18)
        return " ".join(out).replace(" \n\n", "\n\n").strip()


def synth_samples(n: int, seed: int = SEED) -> Iterator[dict[str, str]]:
    """Yield `n` alpaca records (instruction, input, output) with long-tailed lengths."""
    rng = random.Random(seed)
    writer = _Writer(rng)
    for _ in range(n):
        instruction = writer.text(rng.randint(5, 20))
        has_input = rng.random() < 0.4
        inp = writer.text(rng.randint(5, 60)) if has_input else ""
        # Log-normal response: median 75 words (~190 tokens), sigma 0.85; see the module doc.
        out_words = min(1200, max(3, round(math.exp(rng.gauss(math.log(75), 0.85)))))
        yield {"instruction": instruction, "input": inp, "output": writer.text(out_words)}


def write_dataset(data_dir: Path, samples: int) -> Path:
    """Write `synth_alpaca.json` and `dataset_info.json` into `data_dir`; return the JSON path."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / f"{DATASET_NAME}.json"
    records = list(synth_samples(samples))
    path.write_text(json.dumps(records, ensure_ascii=False))
    info = {DATASET_NAME: {"file_name": path.name}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return path


def _tiny_model_module() -> ModuleType:
    """Load scripts/make_tiny_model.py (a script, not a package) as a module."""
    spec = importlib.util.spec_from_file_location("make_tiny_model", TINY_MODEL_SCRIPT)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the tokenizer builder {TINY_MODEL_SCRIPT}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tokenizer(out_dir: Path, corpus_samples: int = 3000) -> Any:  # noqa: ANN401
    """Train a byte-level BPE like the tiny model's on the synthetic corpus, saved beside it.

    The tiny model's special tokens, end and padding tokens (scripts/make_tiny_model.py) with the
    tokenizers library's trainer (the role's own builder is pure Python, too slow for 16k
    entries), so that the tokenizer fits the data it will tokenize.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tiny = _tiny_model_module()
    texts = [
        " ".join((r["instruction"], r["input"], r["output"]))
        for r in synth_samples(corpus_samples, seed=SEED + 1)
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=tiny.SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=tiny.EOS,
        pad_token=tiny.PAD,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    size: str, out_dir: Path, device: str, vocab: int | None = None, dtype: str = "bfloat16"
) -> int:
    """Save a random-initialised Qwen2ForCausalLM of the given shape (bf16); return its size."""
    import torch  # noqa: PLC0415
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415

    shape = {"vocab": MODEL_VOCAB, "tied": 1, **SHAPES[size]}
    vocab = vocab or shape["vocab"]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=bool(shape["tied"]),
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(SEED)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, dtype))
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "bench_model.json").write_text(
        json.dumps({"size": size, "n_params": n_params, **shape, "vocab": vocab}, indent=2) + "\n"
    )
    return n_params


def main() -> None:
    """Parse arguments and write the model, tokenizer and (optionally) dataset."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--data-dir", type=Path, help="also write the synthetic dataset here")
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--device", default="cpu", help="where to initialise the weights")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of the saved weights"
    )
    parser.add_argument(
        "--vocab", type=int, help="model vocabulary (default: the shape's; smaller for CPU tests)"
    )
    args = parser.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(args.out)
    n_params = build_model(args.size, args.out, args.device, args.vocab, args.dtype)
    print(f"model {args.size}: {n_params / 1e6:.1f} M parameters -> {args.out}")
    print(f"tokenizer: {len(tok)} entries, pad={tok.pad_token_id}")
    if args.data_dir:
        path = write_dataset(args.data_dir, args.samples)
        print(f"dataset: {args.samples} samples -> {path}")


if __name__ == "__main__":
    main()
