"""Every hook the engine installs is registered here; bodies delegate to the Scheduler.

`HookSet` keeps the handles so `close()` removes them all (idempotent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from tierzero.engine.access import check_state_dict
from tierzero.swap import trace

if TYPE_CHECKING:
    from tierzero.engine.schedule import Scheduler
    from tierzero.engine.unit import Unit


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors inside a module's output (tuples, dicts, dataclass-like model outputs)."""
    out: list[torch.Tensor] = []
    leaves, _ = tree_flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif isinstance(leaf, Mapping):  # mapping types pytree does not know (model outputs)
            out.extend(output_tensors(list(leaf.values())))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out.extend(output_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def register_pre_backward(
    tensors: list[torch.Tensor], scheduler: Scheduler, unit: Unit
) -> RemovableHandle:
    """Gather `unit` when the first gradient reaches any of its outputs."""

    def hook(_grad: torch.Tensor) -> None:
        scheduler.pre_backward(unit)

    return torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")


class HookSet:
    """Module forward hooks and parameter post-accumulate hooks for every unit."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._handles: list[RemovableHandle] = []
        for unit in scheduler.units:
            if not unit.is_root:  # the engine gathers the root around the whole forward
                self._handles.append(unit.module.register_forward_pre_hook(
                    _pre_forward(scheduler, unit), with_kwargs=True))
                self._handles.append(unit.module.register_forward_hook(
                    _post_forward(scheduler, unit)))
            for p in unit.trainable:
                self._handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    _post_accumulate(scheduler, unit)))
            if unit.is_root:  # the whole model: refuse to save released (empty) parameters
                self._handles.append(unit.module.register_state_dict_post_hook(  # type: ignore[no-untyped-call]
                    check_state_dict))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _pre_forward(scheduler: Scheduler, unit: Unit) -> Any:
    def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        scheduler.pre_forward(unit, args, kwargs)
        trace.begin("compute", unit.label, phase="forward")

    return hook


def _post_forward(scheduler: Scheduler, unit: Unit) -> Any:
    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
        trace.end("compute", unit.label)
        return scheduler.after_forward(unit, output)  # a replacement in a layer-major pass

    return hook


def _post_accumulate(scheduler: Scheduler, unit: Unit) -> Any:
    def hook(param: torch.Tensor) -> None:
        scheduler.post_accumulate(unit, param)  # type: ignore[arg-type]

    return hook
