"""LoRA from `train.lora` through peft, and the names a peft-wrapped model's weights had.

peft wraps each targeted Linear as `<name>.base_layer` (the frozen original)
next to `<name>.lora_A.<adapter>` / `lora_B.<adapter>`; a `PeftModel` adds
`base_model.model.` in front of every name. The engine partitions the wrapped
model like any other: the base weights land in frozen flat groups (only
`param`, no optimizer state), the adapters in trainable ones.
`peft_aliases` maps the wrapped names back to the original checkpoint's, so
`load_pretrained` fills the frozen base from an unwrapped Hugging Face
checkpoint and leaves the adapters as peft initialised them.
"""

from __future__ import annotations

import sys

from torch import nn

from tierzero.engine.config.train import LoraConfig

PEFT_PREFIX = "base_model.model."  # what PeftModel puts in front of the wrapped model's names


class LoraError(ValueError):
    """train.lora cannot be applied; the message names the key and the way out."""


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`model` wrapped in peft LoRA adapters (cfg.r > 0), base frozen; else `model`."""
    if cfg.r == 0:
        return model
    try:
        import peft
    except ImportError as exc:
        raise LoraError("train.lora.r > 0 needs the peft package: pip install "
                        "'tierzero[hf]'") from exc
    targets = list(cfg.target_modules) or None
    lcfg = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha,  # type: ignore[arg-type]
                           lora_dropout=cfg.dropout, target_modules=targets,
                           task_type="CAUSAL_LM")
    try:
        wrapped: nn.Module = peft.get_peft_model(model, lcfg)  # type: ignore[arg-type,unused-ignore]
    except ValueError as exc:  # peft: no default targets, or targets that match nothing
        raise LoraError(f"train.lora.target_modules {list(cfg.target_modules)}: {exc}; name "
                        "the model's Linear modules to adapt, e.g. [q_proj, v_proj]") from exc
    return wrapped


def is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a model can only be wrapped if peft was imported
    return peft is not None and isinstance(module, peft.PeftModel)


def adapter_parameters(module: nn.Module) -> set[str]:
    """Qualified names of every adapter parameter (peft tuner layers' adapter_layer_names)."""
    peft = sys.modules.get("peft")
    if peft is None:
        return set()
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: set[str] = set()
    for mname, mod in module.named_modules():
        if not isinstance(mod, BaseTunerLayer):
            continue
        for attr in mod.adapter_layer_names:
            holder = getattr(mod, attr, None)
            if isinstance(holder, nn.Module):
                prefix = f"{mname}.{attr}." if mname else f"{attr}."
                out |= {prefix + n for n, _ in holder.named_parameters()}
    return out


def base_name(name: str, peft_model: bool) -> str:
    """The name `name` had before peft wrapped the model."""
    if peft_model:
        name = name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def peft_aliases(module: nn.Module) -> tuple[dict[str, str], set[str]]:
    """({wrapped parameter/buffer name: original name}, adapter parameter names) of a
    peft-wrapped model; ({}, set()) for any other."""
    adapters = adapter_parameters(module)
    wrapped = is_peft_model(module)
    if not adapters and not wrapped:
        return {}, set()
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in module.named_buffers()]
    aliases = {n: base_name(n, wrapped) for n in names if n not in adapters}
    return {n: a for n, a in aliases.items() if n != a}, adapters
