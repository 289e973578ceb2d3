"""`plan --model`: a model built on the meta device, cut into units by the engine's own rule.

Accepted: `builtin:<size>` (engine.models), a Hugging Face config.json or a
directory holding one (built with `transformers` on meta tensors: no memory,
no weights), or a parameter count (`7e9`, `40B`, `125M`), planned as
`layers` equal blocks with nothing in the root unit. Units come from
engine.units.discover_units, the code the engine partitions with.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.models import SIZES, TinyLM
from engine.train.model_source import ModelError, builtin_config, describe_sizes
from engine.units import discover_units

_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", re.I)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


@dataclass(frozen=True)
class ModelShape:
    name: str
    units: tuple[tuple[str, int], ...]  # (unit name, parameters), root last as "<root>"

    @property
    def parameters(self) -> int:
        return sum(n for _, n in self.units)


def parse_count(text: str) -> int | None:
    match = _COUNT.match(text)
    if not match:
        return None
    return int(float(match.group(1)) * _SCALE[match.group(2).lower()])


def model_shape(spec: str, *, layers: int = 32, unit_min_bytes: int = 16 << 20) -> ModelShape:
    count = parse_count(spec)
    if count is not None:
        if count < layers:
            raise ModelError(f"--model {spec}: {count} parameters cannot fill {layers} layers")
        per, extra = divmod(count, layers)
        return ModelShape(f"{count:,} parameters in {layers} equal blocks",
                          tuple((f"blocks.{i}", per + (i < extra)) for i in range(layers)))
    module = _meta_module(spec)
    specs = discover_units(module, None, unit_min_bytes)
    units = tuple((s.name or "<root>", sum(p.numel() for _, p in s.params)) for s in specs)
    return ModelShape(spec, units)


def _meta_module(spec: str) -> nn.Module:
    if spec.startswith("builtin:") or spec in SIZES:
        cfg = builtin_config(spec if spec.startswith("builtin:") else f"builtin:{spec}")
        with torch.device("meta"):
            return TinyLM(cfg)
    config_file = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(config_file):
        raise ModelError(f"--model {spec!r}: unknown model; allowed: {describe_sizes()}, a "
                         "Hugging Face config.json (or its directory), or a parameter count "
                         "such as 7e9 or 40B")
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(f"--model {spec!r} is a Hugging Face config, which needs the "
                         "transformers package: pip install 'tierzero[hf]'") from exc
    hf_config = transformers.AutoConfig.from_pretrained(config_file)
    with torch.device("meta"):
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call,unused-ignore]
            hf_config)
    return model
