"""Clear errors for partitioned parameters used where they are not gathered, and the fix.

While the engine runs a forward, `AccessGuard` (a TorchFunctionMode) checks
each torch call's tensor arguments: a partitioned parameter that is released
(size-0 data) raises `ParameterNotGatheredError` naming it and the fix,
instead of a shape error deep inside a kernel or, worse, a silent result of
an empty tensor. `GatheredParameters` is that fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from tierzero.engine.schedule import Scheduler
    from tierzero.engine.unit import Unit


class ParameterNotGatheredError(RuntimeError):
    """A partitioned parameter was used while it held no data."""


@dataclass(frozen=True)
class _Owner:
    scheduler: Scheduler
    unit: Unit
    qname: str
    numel: int  # true size; a zero-size parameter needs no gathering


# The one process-wide table: which engine partitioned a parameter. DESIGN's
# `GatheredParameters(params)` takes parameters alone, so it must find their
# engine from the parameter; weak keys by identity, so nothing on the user's
# parameter and no reference keeping it alive.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_owner(param: nn.Parameter, scheduler: Scheduler, unit: Unit, qname: str,
                   numel: int) -> None:
    _OWNERS[param] = _Owner(scheduler, unit, qname, numel)


def unregister_owner(param: nn.Parameter) -> None:
    _OWNERS.pop(param, None)  # type: ignore[no-untyped-call]


def owner_of(param: object) -> _Owner | None:
    owner = _OWNERS.get(param)  # type: ignore[no-untyped-call]
    return owner if isinstance(owner, _Owner) else None


def _not_gathered(owner: _Owner, func: Any) -> ParameterNotGatheredError:
    name = getattr(func, "__name__", str(func))
    return ParameterNotGatheredError(
        f"parameter {owner.qname!r} (unit {owner.unit.label!r}) is partitioned and not "
        f"gathered here, but {name}() used it outside its unit's forward. Wrap the access in "
        f"`with engine.GatheredParameters([param]): ...` or list the module using it in "
        f"zero.units together with the parameter's owner")


# The `.data` descriptor (defined on torch's C tensor base class, whose name varies
# between releases).
_DATA = next(c.__dict__["data"] for c in torch.Tensor.__mro__ if "data" in c.__dict__)


def check_state_dict(module: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                     _local_metadata: Any) -> None:
    """The model's state_dict post-hook: a partitioned parameter released at this moment
    would be saved as an empty tensor (a checkpoint of nothing), so raise instead."""
    # keep_vars=True hands out the live Parameters themselves (the engine reads names
    # that way): nothing is copied, so nothing empty is saved; only copies are checked.
    released = [prefix + name for name, p in module.named_parameters(remove_duplicate=False)
                if (o := owner_of(p)) is not None and o.numel and p.numel() == 0
                and prefix + name in state_dict and state_dict[prefix + name] is not p]
    if released:
        shown = ", ".join(repr(n) for n in released[:3]) + (", ..." if len(released) > 3 else "")
        raise ParameterNotGatheredError(
            f"state_dict(): {len(released)} partitioned parameter(s) are released here and "
            f"would be saved as empty tensors ({shown}). Gather them first: `with "
            f"tierzero.GatheredParameters(model.parameters()): sd = model.state_dict()` (a "
            f"collective: every rank enters it), or save with eng.save_checkpoint() and "
            f"build a full state dict with tierzero.consolidate()")


class AccessGuard(TorchFunctionMode):
    """Active only inside the engine's forward; see the module docstring."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
            # `param.data = ...`: the engine itself pointing a parameter at its view
            return func(*args, **kwargs)
        for a in (*args, *kwargs.values()):
            if isinstance(a, list | tuple):
                for b in a:
                    self._check(b, func)
            else:
                self._check(a, func)
        return func(*args, **kwargs)

    @staticmethod
    def _check(a: object, func: Any) -> None:
        if isinstance(a, nn.Parameter) and a.numel() == 0:
            owner = owner_of(a)
            if owner is not None and owner.numel and not owner.unit.gathered:
                raise _not_gathered(owner, func)


class GatheredParameters:
    """Gather the units owning `params` for the body of a `with` block.

    A collective: every rank must enter it. With `modifier_rank` set, changes
    made to the full parameters on that rank are broadcast and written back
    into every rank's shards (master and compute copies) on exit. Parameters
    no engine partitioned pass through untouched.
    """

    def __init__(self, params: Iterable[nn.Parameter] | nn.Parameter,
                 modifier_rank: int | None = None, enabled: bool = True) -> None:
        plist = [params] if isinstance(params, torch.Tensor) else list(params)
        self._owners = [o for o in (owner_of(p) for p in plist) if o is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._units: list[Unit] = []
        self._opened: list[Unit] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        seen: set[int] = set()
        for o in self._owners:
            if id(o.unit) not in seen:
                seen.add(id(o.unit))
                self._units.append(o.unit)
                if not o.unit.current:
                    self._opened.append(o.unit)
                o.scheduler.ensure_gathered(o.unit)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        sched = {id(o.unit): o.scheduler for o in self._owners}
        if self.modifier_rank is not None and exc_type is None:
            for unit in self._units:
                unit.write_back(sched[id(unit)].comm, sched[id(unit)].store, self.modifier_rank)
        if torch.is_grad_enabled() and _in_engine_forward():
            # Inside a training forward autograd may have saved views of these
            # parameters: the scheduler releases the units after their gradients are
            # reduced or at the end of backward, as for any unit used in the forward.
            return
        for unit in self._opened:
            sched[id(unit)].release(unit)


def _in_engine_forward() -> bool:
    """True inside `ZeroEngine.forward` (its AccessGuard is on the torch function mode stack)."""
    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    return any(isinstance(m, AccessGuard) for m in stack)
