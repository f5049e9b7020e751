"""Build a tiny random-weight Llama plus a locally trained BPE tokenizer (no network).

Used by the tests, the demo and the benchmarks: nothing is ever downloaded.
head_dim (hidden / heads) must be >= 32 or vLLM's CPU attention refuses it.

    python -m sampler_pod.tiny_model OUT_DIR [--seed 0] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _synthetic_corpus(n: int = 3000, seed: int = 0) -> Iterator[str]:
    rng = random.Random(seed)
    words = (
        "the a cat dog runs jumps over under big small red blue one two three four five "
        "six seven eight nine ten plus minus equals answer question what is hello world "
        "model sample token reward policy value step"
    ).split()
    for _ in range(n):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) + f" {rng.randint(0, 999)}"


def _build_tokenizer(vocab_size: int) -> Any:  # a transformers PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out: Path, *, seed: int = 0, hidden: int = 128, layers: int = 2,
                     vocab: int = 512, dtype: str = "float32") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden // 4 < 32:
        raise ValueError("hidden must be >= 128 (4 heads, head_dim >= 32 for vLLM's CPU attention)")
    torch.manual_seed(seed)
    tok = _build_tokenizer(vocab)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    cfg.dtype = dtype
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    readable_by_all(out)
    return out


def readable_by_all(model_dir: Path) -> bool:
    """Make a model directory readable by every uid (files 0644, directories 0755); True if a mode changed.

    The sampler images run as a non-root uid (USER 1000:0, or any uid in group 0 under OpenShift), and the
    pods mount this directory from the host read-only. Hugging Face's safetensors writer leaves
    model.safetensors 0600 (it writes through a private temporary file), which only root could read:
    a non-root engine then cannot load the model at all."""
    changed = False
    for p in [model_dir, *model_dir.rglob("*")]:
        want = 0o755 if p.is_dir() else 0o644
        if not p.is_symlink() and p.stat().st_mode & 0o777 != want:
            p.chmod(want)
            changed = True
    return changed


def cached_tiny_model(cache_dir: Path | None = None, **kw: Any) -> Path:
    """Build once per parameter set into the cache; concurrent callers are serialized."""
    from filelock import FileLock

    base = cache_dir or Path(os.environ.get("SAMPLER_CACHE_DIR", Path.home() / ".cache/sampler-operator")) / "models"
    tag = "tiny-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items())) if kw else "tiny-default"
    out = base / tag
    base.mkdir(parents=True, exist_ok=True)
    with FileLock(str(base / f"{tag}.lock")):
        if not (out / ".complete").exists():
            tmp = base / f"{tag}.tmp"
            build_tiny_model(tmp, **kw)
            (tmp / ".complete").touch()
            if out.exists():
                import shutil
                shutil.rmtree(out)
            tmp.rename(out)
        # A cache built before the models were made readable by every uid is fixed in place.
        readable_by_all(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    build_tiny_model(a.out, seed=a.seed, hidden=a.hidden, layers=a.layers, vocab=a.vocab, dtype=a.dtype)
    print(a.out)


if __name__ == "__main__":
    main()
