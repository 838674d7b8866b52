"""Check that Liger kernels work with this torch/triton/transformers on the GPU.

Builds a small Qwen2 model (real vocabulary size, 2 layers), computes loss and gradients without
and with Liger's Qwen2 patches (same weights, same batch), and exits 1 if Liger fails to run or
the loss differs by more than 2e-2 relative.
"""

from __future__ import annotations

import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def _loss(model: Qwen2ForCausalLM, ids: torch.Tensor) -> float:
    """Return the LM loss of one forward/backward pass."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return float(out.loss)


def main() -> int:
    """Compare plain and Liger-patched Qwen2 on one batch."""
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 16000, (2, 512), device="cuda")
    ref_loss = _loss(ref, ids)
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2  # noqa: PLC0415

        apply_liger_kernel_to_qwen2()
        model = Qwen2ForCausalLM(cfg).cuda().to(torch.bfloat16)
        model.load_state_dict(ref.state_dict())
        liger_loss = _loss(model, ids)
    except Exception as exc:  # any failure means: do not use Liger
        print(f"liger: FAILED {type(exc).__name__}: {exc}")
        return 1
    rel = abs(liger_loss - ref_loss) / abs(ref_loss)
    print(f"liger: loss {liger_loss:.4f} vs plain {ref_loss:.4f} (rel {rel:.2e})")
    return 0 if rel < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
