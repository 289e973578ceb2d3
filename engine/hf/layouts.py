"""Checkpoint layouts that transformers converts on load, mapped for load_pretrained.

transformers 5 fuses a Mixtral block's experts into 3-D parameters but
`save_pretrained` (and every checkpoint on the Hub) keeps the per-expert
layout:

    checkpoint (per layer L, expert e)                 model (per layer L)
    model.layers.L.block_sparse_moe.gate.weight (E, H) -> model.layers.L.mlp.gate.weight
    ...experts.e.w1.weight (I, H)  gate projection   \\
    ...experts.e.w3.weight (I, H)  up projection     /-> ...mlp.experts.gate_up_proj (E, 2I, H)
    ...experts.e.w2.weight (H, I)                    --> ...mlp.experts.down_proj    (E, H, I)

gate_up_proj[e] is w1[e] then w3[e] (the forward splits it with chunk(2) into
gate, up). A fused parameter becomes a composite TensorEntry whose pieces are
read slice by slice like any other tensor, so nothing is materialised whole.
"""

from __future__ import annotations

import re

from tierzero.engine.hf.weights import TensorEntry

_FUSED = re.compile(r"^(?P<base>.*\.)mlp\.experts\.(?P<which>gate_up_proj|down_proj)$")
_GATE = re.compile(r"^(?P<base>.*\.)mlp\.gate\.weight$")


def _composite(name: str, parts: list[TensorEntry], shape: tuple[int, ...]) -> TensorEntry:
    pieces, at = [], 0
    for part in parts:
        pieces.append((part, at))
        at += part.numel
    return TensorEntry(name, parts[0].file, shape, tuple(pieces))


def map_legacy_moe(model_names: set[str], tensors: dict[str, TensorEntry]
                   ) -> dict[str, TensorEntry]:
    """Checkpoint tensors with Mixtral's per-expert layout presented as the model's fused
    parameters; anything else is returned unchanged."""
    out = dict(tensors)
    for name in sorted(model_names - set(tensors)):
        if m := _GATE.match(name):
            legacy = f"{m['base']}block_sparse_moe.gate.weight"
            if legacy in out:
                out[name] = out.pop(legacy)
            continue
        m = _FUSED.match(name)
        if m is None:
            continue
        prefix = f"{m['base']}block_sparse_moe.experts."
        n_experts = 0
        while f"{prefix}{n_experts}.w1.weight" in out:
            n_experts += 1
        names = ("w1", "w3") if m["which"] == "gate_up_proj" else ("w2",)
        keys = [f"{prefix}{e}.{w}.weight" for e in range(n_experts) for w in names]
        if not n_experts or any(k not in out for k in keys):
            continue
        parts = [out.pop(k) for k in keys]
        rows, cols = parts[0].shape
        shape = (n_experts, rows * len(names), cols)
        out[name] = _composite(name, parts, shape)
    return out
