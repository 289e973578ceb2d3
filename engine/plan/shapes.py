"""`plan --model`: a model built on the meta device, cut into units by the engine's own rule.

Accepted: `builtin:<size>` (engine.models), a Hugging Face config.json or a
directory holding one (built with `transformers` on meta tensors: no memory,
no weights), or a parameter count (`7e9`, `40B`, `125M`), built as `layers`
equal blocks (CountBlock, one flat parameter each) with nothing in the root
unit. Units come from engine.units.discover_units, the code the engine
partitions with; the module itself is what the plan's dry run trains
([Note: plan from the engine] in engine/plan/dry_run.py).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from tierzero.engine.models import SIZES, TinyLM
from tierzero.engine.train.model_source import (
    ModelError,
    builtin_config,
    describe_sizes,
    load_hf_config,
)
from tierzero.engine.units import discover_units

_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", re.I)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
UNIT_MIN_BYTES = 16 << 20  # zero.unit_min_bytes' default


class CountBlock(nn.Module):
    """A block of `numel` parameters that the forward really uses (so gradients reach it)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[:1]  # (B, T, 1)


class CountModel(nn.Module):
    """`count` parameters in `layers` equal blocks (the first ones one larger when uneven)."""

    def __init__(self, count: int, layers: int) -> None:
        super().__init__()
        per, extra = divmod(count, layers)
        self.blocks = nn.ModuleList(CountBlock(per + (i < extra)) for i in range(layers))

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        x = input_ids.unsqueeze(-1).float()  # (B, T, 1)
        for block in self.blocks:
            x = block(x)
        return (x,)


@dataclass(frozen=True)
class ModelShape:
    name: str
    units: tuple[tuple[str, int], ...]  # (unit name, parameters); the root as "<root>"
    module: nn.Module | None = None  # built on meta; None for shapes made by hand
    unit_classes: tuple[str, ...] = ()  # zero.units for the dry run ("" = the engine's rule)

    @property
    def parameters(self) -> int:
        return sum(n for _, n in self.units)

    def fresh_module(self) -> nn.Module:
        """A copy of the meta module to hand to an engine (which re-points its params)."""
        if self.module is None:
            raise ModelError(f"model {self.name!r} has no module to run; build it with "
                             "model_shape()")
        return copy.deepcopy(self.module)


def parse_count(text: str) -> int | None:
    match = _COUNT.match(text)
    if not match:
        return None
    return int(float(match.group(1)) * _SCALE[match.group(2).lower()])


def model_shape(spec: str, *, layers: int = 32,
                unit_min_bytes: int = UNIT_MIN_BYTES) -> ModelShape:
    count = parse_count(spec)
    classes: tuple[str, ...] = ()
    if count is not None:
        if count < layers:
            raise ModelError(f"--model {spec}: {count} parameters cannot fill {layers} layers")
        with torch.device("meta"):
            module: nn.Module = CountModel(count, layers)
        name = f"{count:,} parameters in {layers} equal blocks"
        classes = (CountBlock.__name__,)
    else:
        module, name = _meta_module(spec), spec
    specs = discover_units(module, list(classes) or None, unit_min_bytes)
    units = tuple((s.name or "<root>", sum(p.numel() for _, p in s.params)) for s in specs)
    return ModelShape(name, tuple(u for u in units if u[1] > 0), module, classes)


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
    hf_config = load_hf_config(config_file, f"--model {spec!r}")
    import transformers

    with torch.device("meta"):
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call,unused-ignore]
            hf_config, trust_remote_code=False)
    return model
