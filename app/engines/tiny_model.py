"""Build a tiny random Llama + BPE tokenizer locally (no hub downloads, ever).

Tests and the CPU demo serve this with real vLLM engines. Head dim 64 is what
vLLM's CPU attention needs; weights are seeded so every build is identical and
greedy decoding is deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

from app.hardware.specs import get_model

TINY_MODEL_NAME = "tiny-llama"
_CORPUS_SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "large language models serve requests on heterogeneous gpus",
    "each request has an end to end deadline and a predicted output length",
    "weak gpus are used just enough while strong gpus stay free for urgent work",
    "prefill computes the prompt and decode generates one token per iteration",
    "a router picks an instance and a watchdog migrates requests at risk",
    "write a short story about a robot who learns to paint",
    "explain how a hash table works and give an example in python",
    "what is the capital of france and why is it famous",
    "solve the equation two x plus three equals eleven step by step",
)


def _corpus() -> list[str]:
    """Enough varied text for a byte-level BPE with a few thousand merges."""
    words = " ".join(_CORPUS_SENTENCES).split()
    lines = list(_CORPUS_SENTENCES)
    for i in range(2000):
        lines.append(" ".join(words[(i * k) % len(words)] for k in range(1, 12)) + f" {i}")
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    fast.save_pretrained(out_dir)


def build_tiny_llama(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, seeded random float32 weights and tokenizer to `out_dir`.

    Idempotent: an existing complete build is reused.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    marker = out_dir / "goodserve_tiny.json"
    if marker.exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = get_model(TINY_MODEL_NAME)
    build_tokenizer(out_dir, spec.vocab_size)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # larger logits spread -> fewer argmax ties, stabler greedy runs
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    marker.write_text(json.dumps({"seed": seed, "model": TINY_MODEL_NAME}))
    return out_dir
