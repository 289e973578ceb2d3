"""`CPUAdam`: a torch.optim.Optimizer over CPU fp32 tensors, driven by the flat Adam kernel.

Usable on its own like ``DeepSpeedCPUAdam``. Its ``state_dict()`` has exactly
``torch.optim.AdamW``'s layout (per parameter: ``step`` as a float32 scalar
tensor, ``exp_avg``, ``exp_avg_sq``; group keys ``lr``, ``betas``, ``eps``,
``weight_decay``, ``amsgrad``, ``maximize``, ``foreach``, ``capturable``,
``differentiable``, ``fused``, ``decoupled_weight_decay``), so either optimizer
loads the other's. ``adamw=False`` is ``torch.optim.Adam`` (L2 weight decay);
in a group dict it may be given as ``adamw`` or as ``decoupled_weight_decay``.

A parameter may have a bf16/fp16 *shadow* (``attach_shadow``): a tensor of the
same shape that receives the updated master rounded to nearest even in the
same pass, as the compute copy of an offloaded model.

    opt = CPUAdam(model.parameters(), lr=2e-5, weight_decay=0.01)   # fp32 CPU params
    opt.attach_shadow(model.lm_head.weight, w16)                    # optional bf16 copy
    loss.backward(); opt.step(grad_scale=1 / loss_scale); opt.zero_grad()
    torch.save(opt.state_dict(), "opt.pt")   # loadable by torch.optim.AdamW, and back
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .adam_kernel import (
    Backend,
    PreparedStep,
    prepare_step,
    resolve_backend,
    run_prepared,
    to_low_precision,
)
from .adam_math import LOW_PRECISION, AdamHyper
from .adam_threads import AdamThreads

logger = logging.getLogger(__name__)

# Group flags of torch.optim.Adam that change the algorithm; CPUAdam implements only False.
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _check_group_flags(group: Mapping[str, Any], where: str) -> None:
    for key in _UNSUPPORTED:
        if group.get(key, False):
            raise ValueError(
                f"CPUAdam {where}: {key}={group[key]!r} is not supported (only False); "
                "use torch.optim.AdamW for it"
            )


def _check_saved_state(state: Mapping[str, Any], p: torch.Tensor, where: str) -> None:
    """ValueError naming the parameter unless its saved AdamW state fits `p`."""
    for key in ("exp_avg", "exp_avg_sq"):
        m = state.get(key)
        if not isinstance(m, torch.Tensor):
            raise ValueError(
                f"CPUAdam.load_state_dict: {where} has no tensor {key!r} "
                f"(got {type(m).__name__}); the state must come from AdamW/Adam or CPUAdam"
            )
        if not m.is_floating_point() or m.is_sparse:
            raise ValueError(f"CPUAdam.load_state_dict: {where} {key} is {m.dtype}"
                             f"{' (sparse)' if m.is_sparse else ''}; it must be a dense float")
        if m.shape != p.shape:
            raise ValueError(
                f"CPUAdam.load_state_dict: {where} {key} has shape {tuple(m.shape)}, the "
                f"parameter has {tuple(p.shape)}; the state belongs to another model"
            )
    step = state.get("step")
    if not (isinstance(step, (int, float)) and not isinstance(step, bool)) and not (
        isinstance(step, torch.Tensor) and step.numel() == 1
    ):
        raise ValueError(f"CPUAdam.load_state_dict: {where} step is {step!r}; it must be a "
                         "number or a one-element tensor")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU fp32 params, one memory pass per tensor, matching torch.optim.AdamW.

    threads: an int (a pool of that many kernel threads, created on the first step), an
        ``AdamThreads`` shared with other users, or None (all CPUs of this process).
    backend: "auto" (compiled C kernel, else PyTorch ops), "compiled" or "torch".
    weight_decay: None takes torch's default for the algorithm: 0.01 as torch.optim.AdamW
        (adamw=True), 0 as torch.optim.Adam (adamw=False).
    """

    def __init__(  # noqa: PLR0917 - the signature of torch.optim.AdamW / DeepSpeedCPUAdam
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        adamw: bool = True,
        *,
        threads: int | AdamThreads | None = None,
        backend: Backend = "auto",
    ) -> None:
        if weight_decay is None:
            weight_decay = 0.01 if adamw else 0.0
        AdamHyper(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
                  adamw=adamw)  # validates
        resolve_backend(backend)  # an unknown or unavailable backend fails here, not mid-step
        if not isinstance(threads, (int, AdamThreads, type(None))) or (
            isinstance(threads, int) and threads < 1
        ):
            raise ValueError(f"CPUAdam threads={threads!r} is invalid; pass an int >= 1, an "
                             "AdamThreads, or None for all CPUs")
        defaults: dict[str, Any] = {
            "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "decoupled_weight_decay": bool(adamw),
        }
        self._backend: Backend = backend
        self._threads_arg = threads
        self._pool: AdamThreads | None = threads if isinstance(threads, AdamThreads) else None
        self._owns_pool = False
        # id(param) -> (param, shadow); the param is kept so the id stays unique while attached.
        self._shadows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(params, defaults)

    # ---- groups and state -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group fully (flags, hyper-parameters, params), then add it."""
        group = dict(param_group)
        if "adamw" in group:
            group["decoupled_weight_decay"] = bool(group.pop("adamw"))
        params = group.get("params", [])
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        where = f"param group {len(self.param_groups)}"
        _check_group_flags(group, where)
        b1, b2 = group.get("betas", self.defaults["betas"])
        AdamHyper(lr=group.get("lr", self.defaults["lr"]), beta1=b1, beta2=b2,
                  eps=group.get("eps", self.defaults["eps"]),
                  weight_decay=group.get("weight_decay", self.defaults["weight_decay"]))
        for i, p in enumerate(group["params"]):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"CPUAdam {where} param {i} is a {type(p).__name__}, not a Tensor")
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(
                    f"CPUAdam {where} param {i} is {p.dtype} on {p.device}"
                    f"{'' if p.is_contiguous() else ', not contiguous'}; "
                    "it needs contiguous float32 CPU tensors (keep bf16/fp16 copies as shadows)"
                )
        super().add_param_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading, with every parameter's moments checked before anything changes
        and then converted to what the kernel reads: contiguous fp32 CPU tensors in the
        parameter's logical layout (a moment saved for a non-contiguous parameter, or an
        expanded one, is copied element by element, not reinterpreted)."""
        groups = state_dict.get("param_groups", [])
        for i, group in enumerate(groups):
            _check_group_flags(group, f"state_dict param group {i}")
        saved_state = state_dict.get("state", {})
        if len(groups) == len(self.param_groups):
            for gi, (saved, ours) in enumerate(zip(groups, self.param_groups, strict=True)):
                for pi, (key, p) in enumerate(
                    zip(saved.get("params", []), ours["params"], strict=False)
                ):
                    if key in saved_state:
                        _check_saved_state(saved_state[key], p, f"group {gi} param {pi}")
        super().load_state_dict(state_dict)  # checks group and parameter counts itself
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                for key in ("exp_avg", "exp_avg_sq"):
                    m = state[key]
                    if not (m.dtype == torch.float32 and m.device.type == "cpu"
                            and m.is_contiguous() and m.shape == p.shape):
                        state[key] = torch.empty_like(p, memory_format=torch.contiguous_format)
                        state[key].copy_(m)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Unpickled or deep-copied: our own attributes come from __getstate__; keys by id are
        # rebuilt because the params are new objects.
        self.__dict__.setdefault("_backend", "auto")
        self.__dict__.setdefault("_threads_arg", None)
        self.__dict__.setdefault("_pool", None)
        self.__dict__.setdefault("_owns_pool", False)
        shadows = self.__dict__.get("_shadows", {})
        self._shadows = {id(p): (p, s) for p, s in shadows.values()}
        for group in self.param_groups:
            for key, value in self.defaults.items():
                if key not in ("lr", "betas", "eps", "weight_decay"):
                    group.setdefault(key, value)

    def attach_shadow(self, param: torch.Tensor, shadow: torch.Tensor) -> None:
        """Keep `shadow` (bf16/fp16, same shape) equal to `param.to(shadow.dtype)` after each step.

        The shadow is refreshed from the current master now, so it is right from the start.
        """
        if not any(p is param for g in self.param_groups for p in g["params"]):
            raise ValueError(
                "CPUAdam.attach_shadow: param is not in any of this optimizer's groups"
            )
        if shadow.dtype not in LOW_PRECISION or shadow.device.type != "cpu":
            raise ValueError(
                f"CPUAdam.attach_shadow: shadow is {shadow.dtype} on {shadow.device}; "
                "it must be a bfloat16 or float16 CPU tensor"
            )
        if shadow.shape != param.shape or not shadow.is_contiguous():
            raise ValueError(
                f"CPUAdam.attach_shadow: shadow has shape {tuple(shadow.shape)}"
                f"{'' if shadow.is_contiguous() else ' (not contiguous)'}; "
                f"it must be contiguous with the param's shape {tuple(param.shape)}"
            )
        with torch.no_grad():
            to_low_precision(param.detach(), shadow, backend=self._backend)
        self._shadows[id(param)] = (param, shadow)

    def detach_shadow(self, param: torch.Tensor) -> None:
        self._shadows.pop(id(param), None)

    def _threads(self) -> AdamThreads:
        if self._pool is None:
            count = self._threads_arg if isinstance(self._threads_arg, int) else None
            self._pool = AdamThreads(count)
            self._owns_pool = True
        return self._pool

    def _state_of(self, p: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[p]
        if len(state) == 0:
            pool = self._threads()
            # float32 scalar step, as torch.optim.AdamW keeps it on CPU (non-fused, non-capturable).
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = pool.first_touch(torch.empty_like(p))
        return state

    # ---- the update -------------------------------------------------------------------------

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, grad_scale: float = 1.0
    ) -> float | None:
        """One update of every param with a grad; grads are multiplied by `grad_scale` first.

        `grad_scale` folds loss-scale removal and clipping (`1/scale * clip_coef`) into the
        same pass instead of a separate sweep over the gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pool = self._threads()
        for gi, group in enumerate(self.param_groups):
            b1, b2 = group["betas"]
            # float(): a group may hold 0-d tensors (torch allows a tensor lr).
            hyper = AdamHyper(lr=float(group["lr"]), beta1=float(b1), beta2=float(b2),
                              eps=float(group["eps"]),
                              weight_decay=float(group["weight_decay"]),
                              adamw=bool(group["decoupled_weight_decay"]))
            steps: dict[float, PreparedStep] = {}
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise ValueError(f"CPUAdam group {gi} param {pi}: sparse gradients are not "
                                     "supported; use torch.optim.SparseAdam")
                state = self._state_of(p)
                if not torch.is_tensor(state["step"]):  # e.g. an int from another optimizer
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                state["step"] += 1
                entry = self._shadows.get(id(p))
                step = float(state["step"])
                prepared = steps.get(step)
                if prepared is None:  # params of a group normally share one step count
                    prepared = prepare_step(hyper, step, grad_scale, self._backend)
                    steps[step] = prepared
                # p.data may have been swapped since the param was added; run_prepared then
                # checks every operand (the C kernel trusts their sizes).
                shadow = entry[1] if entry is not None else None
                if (p.dtype != torch.float32 or not p.is_contiguous()
                        or state["exp_avg"].numel() != p.numel()
                        or (shadow is not None and shadow.numel() != p.numel())):
                    raise ValueError(
                        f"CPUAdam group {gi} param {pi} changed since it was added (now "
                        f"{p.dtype}, {tuple(p.shape)}, contiguous={p.is_contiguous()}); its "
                        "state or shadow no longer fits; build a new optimizer")
                try:
                    run_prepared(
                        prepared, p.detach(), state["exp_avg"], state["exp_avg_sq"],
                        grad.detach().contiguous(), shadow=shadow, threads=pool,
                    )
                except ValueError as exc:
                    raise ValueError(f"CPUAdam group {gi} param {pi}: {exc}") from exc
        return loss

    def close(self) -> None:
        """Stop the kernel threads this optimizer created (a shared AdamThreads is left alone)."""
        if self._owns_pool and self._pool is not None:
            self._pool.close()
            self._pool = None
            self._owns_pool = False

    def __enter__(self) -> CPUAdam:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # The pool is a process resource: never pickled or deep-copied, recreated on demand.
        state = dict(super().__getstate__())
        state["_backend"] = self._backend
        state["_threads_arg"] = self._threads_arg if isinstance(self._threads_arg, int) else None
        state["_shadows"] = dict(self._shadows)
        return state
