"""The seam between the engine and whatever updates the fp32 master shards.

The engine hands the optimizer one fp32 master tensor per trainable flat
group and, before each step, points its `.grad` at the gradient shard (an fp32 copy of
one kept at compute precision, [Note: gradient precision]).
Adam-family optimizers get their `exp_avg` / `exp_avg_sq` pre-seeded from the
shard store, so optimizer state lives where the store puts it ([Note: shard
residency]). Any `torch.optim.Optimizer` over flat tensors fits here:
`offload.CPUAdam` drops in as another `OptimizerFactory`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.shards.store import ShardStore
from tierzero.offload.settings import MOMENT_CLASSES
from tierzero.offload.step_seam import GroupState, StoreTensor

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

_TORCH_OPTIMIZERS: dict[str, type[torch.optim.Adam] | type[torch.optim.AdamW]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
}


def torch_adam_factory(
    kind: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> OptimizerFactory:
    cls = _TORCH_OPTIMIZERS.get(kind)
    if cls is None:
        raise ValueError(f"optimizer.type {kind!r} is not one of {sorted(_TORCH_OPTIMIZERS)}")

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # One fused kernel per step on CUDA and on the CPU: the baseline users compare
        # against, and faster than foreach on the CPU (benchmarks/RESULTS.md,
        # "Measurements behind design choices").
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)

    return make


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor takes: `defaults` may hold more
    (torch.optim.AdamW's has `decoupled_weight_decay`, which AdamW() refuses)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def factory_from_user(optimizer: object) -> OptimizerFactory:
    """`optimizer=` of initialize(): a callable `params -> Optimizer`, or an Optimizer built
    over the model's parameters, rebuilt over the master shards with the same defaults."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1:
            raise ValueError(
                f"optimizer= has {len(optimizer.param_groups)} param groups; the engine "
                "rebuilds it over flat master shards and supports one group. Pass a callable "
                "params -> Optimizer instead")
        cls, defaults = type(optimizer), _constructor_kwargs(optimizer)
        return lambda params: cls(params, **defaults)
    if callable(optimizer):
        return optimizer
    raise TypeError(f"optimizer= must be a torch.optim.Optimizer or a callable params -> "
                    f"Optimizer; got {type(optimizer).__name__}")


def build_optimizer(
    factory: OptimizerFactory, store: ShardStore, keys: Sequence[str]
) -> torch.optim.Optimizer:
    masters = [store.tensor(k, "master") for k in keys]
    opt = factory(masters)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer factory returned {type(opt).__name__}, expected a "
                        "torch.optim.Optimizer")
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW) and not any(
            g.get("amsgrad") for g in opt.param_groups):
        for k, m in zip(keys, masters, strict=True):
            group = next(g for g in opt.param_groups if any(p is m for p in g["params"]))
            # fused / capturable kernels keep the step count on the parameter's device
            on_device = bool(group.get("fused") or group.get("capturable"))
            opt.state[m] = {
                "step": torch.zeros((), dtype=torch.float32,
                                    device=m.device if on_device else torch.device("cpu")),
                "exp_avg": store.tensor(k, "exp_avg"),
                "exp_avg_sq": store.tensor(k, "exp_avg_sq"),
            }
    return opt


def run_step(
    opt: torch.optim.Optimizer, store: ShardStore, keys: Sequence[str], grad_scale: float = 1.0
) -> None:
    """One optimizer step over the masters (gradients times `grad_scale`), then param <-
    master. A gradient shard kept at compute precision is handed to the optimizer as an
    fp32 copy for the step ([Note: gradient precision] in shards/grad_precision.py): the
    shard itself is scaled where it is fp32, the copy where it is not, the same values."""
    masters = [store.tensor(k, "master") for k in keys]
    for k, m in zip(keys, masters, strict=True):
        grad = store.tensor(k, "grad")
        m.grad = grad if grad.dtype == m.dtype else grad.to(m.dtype)
        if grad_scale != 1.0:
            m.grad.mul_(grad_scale)
    try:
        opt.step()
    finally:
        for m in masters:
            m.grad = None
    for k in keys:
        store.write_param_from_master(k)


class DeviceStep:
    """The step seam's device driver ([Note: the optimizer-step seam] in
    offload/step_seam.py): a torch optimizer over device-resident master shards, stepped
    once backward is over. Nothing runs during backward or beside compute."""

    def __init__(self, optimizer: torch.optim.Optimizer, store: ShardStore,
                 keys: Sequence[str]) -> None:
        self.optimizer = optimizer
        self._store = store
        self._keys = list(keys)
        self.last_update: str | None = None  # "step" once a step ran (StepDriver)
        # torch's optimizer steps on this thread in step(): a failure is raised there; no
        # update is kept as partial ([Note: a partial step] in engine/step/offloaded.py)
        self.partial_step: str | None = None

    @property
    def listening(self) -> bool:
        return False

    @property
    def updates_in_backward(self) -> bool:
        return False

    @property
    def defers(self) -> bool:
        return False

    @property
    def step_open(self) -> bool:
        return False

    @property
    def step_order(self) -> list[str]:
        return list(self._keys)

    def begin(self, *, boundary: bool, unscale: float = 1.0) -> None:
        del boundary, unscale  # the step starts after backward

    def before_use(self) -> None:
        """Nothing is updated before step()."""

    def groups_final(self, keys: Sequence[str]) -> None:
        del keys  # never listening

    def abandon(self) -> None:
        """Nothing was begun during backward."""

    def take_abandoned(self) -> bool:
        return False

    def grad_stats(self, redo: set[str]) -> None:
        del redo  # nothing is measured during backward

    def finish(self, grad_scale: float, *, next_forward: Sequence[str],
               seen: Sequence[str]) -> None:
        del next_forward, seen  # stepped here, in one call over every shard
        run_step(self.optimizer, self._store, self._keys, grad_scale)
        self.last_update = "step"

    def gradients_zeroed(self) -> None:
        """Nothing measured to forget."""

    def settle(self, *, deferred: bool = True) -> None:
        del deferred  # the step runs on the caller's thread

    def wait_groups(self, keys: Sequence[str]) -> None:
        del keys  # nothing deferred

    def drain(self) -> None:
        """Nothing deferred."""

    def watch_deferred(self) -> None:
        """Nothing deferred."""

    def worker_times(self) -> tuple[float, float]:
        return 0.0, 0.0

    def stats(self) -> dict[str, Any] | None:
        return None

    # -- checkpoints ([Note: the optimizer-step seam]) -------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per group: the store's moments (the optimizer's own when pre-seeded, see
        build_optimizer), its other per-element tensors, and its scalars (`step`)."""
        state = {}
        for key in self._keys:
            out = GroupState(shards=store_moments(self._store, key))
            master = self._store.tensor(key, "master")
            for name, value in self.optimizer.state.get(master, {}).items():
                if isinstance(value, torch.Tensor):
                    if self._store.has(key, name) and value is self._store.tensor(key, name):
                        continue  # saved as the shard itself
                    if value.numel() == master.numel() and value.dim() == 1:
                        out.tensors[name] = value
                    elif value.numel() == 1:
                        out.scalars[name] = {"tensor": value.item(), "dtype": str(value.dtype)}
                    else:
                        raise CheckpointError(
                            f"optimizer state {name!r} of group {key!r} has shape "
                            f"{list(value.shape)}: neither per-element nor scalar, so it "
                            "cannot be saved with the shards")
                elif isinstance(value, bool | int | float | str) or value is None:
                    out.scalars[name] = value
                else:
                    raise CheckpointError(f"optimizer state {name!r} of group {key!r} is a "
                                          f"{type(value).__name__}; checkpoints hold tensors "
                                          "and JSON scalars")
            state[key] = out
        return {"param_groups": hyper_params(self.optimizer), "state": state}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_hyper_params(self.optimizer, state["param_groups"])
        groups: Mapping[str, GroupState] = state["state"]
        for key, group in groups.items():
            load_store_moments(self._store, key, group)
            master = self._store.tensor(key, "master")
            mine = self.optimizer.state.setdefault(master, {})
            for name, source in group.tensors.items():
                dest = mine.get(name)
                if not isinstance(dest, torch.Tensor):
                    raise CheckpointError(
                        f"checkpoint holds optimizer state 'optim.{name}' for {key!r}, but "
                        "this engine's optimizer has none: load with the same optimizer type")
                source.read_into(dest)
            for name, value in group.scalars.items():
                if isinstance(value, dict):
                    cur = mine.get(name)
                    device = cur.device if isinstance(cur, torch.Tensor) else torch.device("cpu")
                    dtype = getattr(torch, value["dtype"].removeprefix("torch."))
                    mine[name] = torch.tensor(value["tensor"], dtype=dtype, device=device)
                else:
                    mine[name] = value

    def close(self) -> None:
        """The optimizer's tensors are the store's, freed with it."""


def store_moments(store: ShardStore, key: str) -> dict[str, Any]:
    """The moments the store keeps for group `key`, by kind (saved streamed from it)."""
    return {kind: StoreTensor(key, kind) for kind in MOMENT_CLASSES if store.has(key, kind)}


def load_store_moments(store: ShardStore, key: str, group: GroupState) -> None:
    """Read the saved moments of group `key` into the store's shards, one at a time, on
    their home tier (every element is replaced: an NVMe shard's old bytes are not read):
    as stored bytes when the source's layout is the store's, else as fp32 values that the
    store encodes ([Note: compressed moments in checkpoints])."""
    for kind, source in group.shards.items():
        if kind not in MOMENT_CLASSES or not store.has(key, kind):
            raise CheckpointError(f"checkpoint holds shard {kind!r} of group {key!r}, which "
                                  "the shard store does not keep as optimizer state")
        stored = source.stored_as()
        if stored is not None and stored == store.moment_layout(key, kind):
            with store.use_stored(key, kind, overwrite=True) as t:  # the bytes as they are
                source.read_stored_into(t)
            continue
        with store.use(key, kind, overwrite=True, compute=False) as t:  # fp32, encoded on exit
            source.read_into(t)


def hyper_params(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters that JSON holds (tuples as lists), no params."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
             if k != "params" and _jsonable(v)} for g in optimizer.param_groups]


def load_hyper_params(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]], *,
                      known_only: bool = False) -> None:
    """Saved hyper-parameters into the param groups (lists back to tuples where the group
    holds a tuple); `known_only`: keys the group does not have are left out."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint has {len(saved)} optimizer param groups, "
                              f"the engine {len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, saved, strict=True):
        for k, v in saved_group.items():
            if known_only and k not in group:
                continue
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


def _jsonable(v: Any) -> bool:
    if isinstance(v, list | tuple):
        return all(_jsonable(x) for x in v)
    return isinstance(v, bool | int | float | str) or v is None
