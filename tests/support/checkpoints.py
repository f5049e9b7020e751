"""Make new weights for the tiny model, and Hugging Face references to check the engine against."""

from __future__ import annotations

from pathlib import Path

import torch


def _load(model_dir: Path):  # -> LlamaForCausalLM
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def perturbed_checkpoint(model_dir: Path, out: Path, *, scale: float = 0.05, seed: int = 1) -> Path:
    """A new full checkpoint: every weight nudged, and a sharper head so greedy paths are unambiguous."""
    model = _load(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
            if name == "lm_head.weight":
                p.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


def hf_prompt_logprobs(model_dir: Path, prompt: list[int], adapter_dir: Path | None = None) -> list[float]:
    """logprob of each prompt token given its prefix (positions 1..n-1), float32."""
    model = _load(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, adapter_dir: Path | None = None) -> list[int]:
    """Hugging Face's greedy tokens (no EOS stop), through a PEFT LoRA adapter when one is given."""
    model = _load(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_lora_adapter(model_dir: Path, out: Path, *, r: int = 8, seed: int = 0, scale: float = 0.5,
                      target_modules: tuple[str, ...] = ("q_proj", "v_proj")) -> Path:
    """A PEFT LoRA adapter with non-zero B (PEFT's default init makes B zero: a no-op adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(_load(model_dir), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(target_modules),
                                                        init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * scale)
    model.save_pretrained(out)
    return out
