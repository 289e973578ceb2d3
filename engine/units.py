"""Which modules become units: the grain at which parameters are gathered and released.

Rule, first match wins:
1. the module class names listed in config (`zero.units`);
2. the model's own `_no_split_modules` (Hugging Face transformer blocks);
3. a size rule: the smallest submodules holding at least `unit_min_bytes` of
   parameters (a module qualifies when it reaches the bound and none of its
   children does), so any model gets useful units.
Then leaf modules are kept whole ([Note: units and rank divergence]). Everything not
inside a chosen module belongs to the root unit.

[Note: units and rank divergence] Every unit gather and gradient reduction is a
collective, so every rank must gather and reduce the same units in the same order.
A module whose submodules run depending on the data, a mixture-of-experts block
whose tokens choose the experts, breaks that as soon as a unit lies inside it:
ranks whose tokens choose different experts gather different units and wait for
each other forever (or, worse, exchange two same-sized units). So a *leaf module*
is never split: the unit rule's units inside it are replaced by one unit for the
whole module, and one that no unit covers becomes a unit of its own (never part
of the root, whose groups are reduced as each completes). Leaf modules are the
classes in `zero.leaf_modules` and, with `zero.auto_leaf_moe` (default), every
module with an `experts` child: the MoE blocks of transformers models (Mixtral,
Qwen2-MoE, ...), as DeepSpeed's `set_z3_leaf_modules` does for them. Inside such a
unit a parameter may get a gradient on one rank and not on another, so the unit is
`dynamic`: its gradients are reduced at the end of backward, in fixed unit order,
never when its parameters happen to be complete on one rank. What is still left to
diverge (user control flow around units) is caught by the order check and the
timeout in engine/collectives.py, as an error on every rank naming the units.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitSpec:
    """A unit before partitioning: its module, its name and the parameters it owns."""

    name: str  # qualified module name; "" for the root unit
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]  # (qualified parameter name, parameter)
    is_root: bool
    dynamic: bool = False  # holds a leaf module ([Note: units and rank divergence])


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _param_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _blocks_by_class(model: nn.Module, classes: set[str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, mod in model.named_modules():
        if name and any(name.startswith(prefix + ".") for prefix in inside):
            continue  # a block nested in a block belongs to the outer one
        if type(mod).__name__ in classes and mod is not model:
            found.append((name, mod))
            inside.append(name)
    return found


def _blocks_by_size(model: nn.Module, min_bytes: int) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> bool:
        """Visit children first; returns True when `mod` or a descendant became a unit."""
        child_hit = False
        for cname, child in mod.named_children():
            if visit(f"{prefix}.{cname}" if prefix else cname, child):
                child_hit = True
        # A container (ModuleList/ModuleDict) has no forward of its own, so hooks on
        # it never fire: it can hold units but never be one.
        if child_hit or mod is model or isinstance(mod, _CONTAINERS):
            return child_hit
        if _param_bytes(mod) >= min_bytes:
            found.append((prefix, mod))
            return True
        return False

    visit("", model)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(found, key=lambda item: order[item[0]])


def _no_split(model: nn.Module) -> list[str]:
    """`_no_split_modules` of the model, or of the outermost submodules that declare it
    (a user wrapper around a Hugging Face model gets the HF blocks as units)."""
    names: list[str] = []
    for _, mod in model.named_modules():
        declared = getattr(mod, "_no_split_modules", None)
        if isinstance(declared, list | tuple | set):
            names.extend(str(n) for n in declared if str(n) not in names)
            if mod is model:
                break
    return names


def _leaf_modules(model: nn.Module, classes: set[str],
                  auto_moe: bool) -> list[tuple[str, nn.Module]]:
    """The outermost modules never to split ([Note: units and rank divergence])."""
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if not name or isinstance(mod, _CONTAINERS) or _param_bytes(mod) == 0:
            continue  # the model itself is the root; a container has no forward
        if any(name.startswith(f + ".") for f, _ in found):
            continue
        if type(mod).__name__ in classes or (auto_moe and "experts" in mod._modules):
            found.append((name, mod))
    return found


def _keep_leaves_whole(model: nn.Module, blocks: list[tuple[str, nn.Module]],
                       leaves: list[tuple[str, nn.Module]],
                       rule: str) -> tuple[list[tuple[str, nn.Module]], set[str]]:
    """`blocks` with every leaf whole; also the names of the blocks holding a leaf."""
    out = list(blocks)
    dynamic: set[str] = set()
    merged: list[str] = []
    for lname, lmod in leaves:
        outer = [b for b, _ in out if lname == b or lname.startswith(b + ".")]
        if outer:  # the leaf is a unit, or inside one
            dynamic.add(outer[0])
            continue
        split = [b for b, _ in out if b.startswith(lname + ".")]
        out = [(b, m) for b, m in out if not b.startswith(lname + ".")]
        out.append((lname, lmod))
        dynamic.add(lname)
        if split:
            merged.append(f"{type(lmod).__name__} {lname!r} ({len(split)} units)")
    if merged:
        log.warning("units: %s splits %d leaf modules (%s); each is kept whole as one unit, "
                    "because ranks whose tokens take different paths through it would run "
                    "different collectives (zero.leaf_modules, zero.auto_leaf_moe)", rule,
                    len(merged), ", ".join(merged[:3]) + (", ..." if len(merged) > 3 else ""))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(out, key=lambda item: order[item[0]]), dynamic


def _enclosing_block(module_name: str, block_of_path: dict[str, int]) -> int | None:
    parts = module_name.split(".") if module_name else []
    for k in range(len(parts), 0, -1):
        hit = block_of_path.get(".".join(parts[:k]))
        if hit is not None:
            return hit
    return None


def discover_units(
    model: nn.Module, class_names: list[str] | None, unit_min_bytes: int,
    leaf_classes: list[str] | None = None, auto_leaf_moe: bool = True,
) -> list[UnitSpec]:
    """Split `model` into block units plus a root unit (last) holding everything else.

    Each parameter is owned by exactly one unit: the first (in module order)
    whose subtree holds it; a parameter tied across units goes to the root.
    Leaf modules (`leaf_classes`, and with `auto_leaf_moe` every module with an
    `experts` child) are never split ([Note: units and rank divergence]).
    """
    if class_names:
        wanted = set(class_names)
        blocks = _blocks_by_class(model, wanted)
        present = {type(m).__name__ for _, m in model.named_modules()}
        missing = sorted(wanted - present)
        if missing:
            raise ValueError(
                f"zero.units names module classes {missing} that the model does not contain; "
                f"classes present include {sorted(present)[:20]}"
            )
        rule = f"zero.units {sorted(wanted)}"
    elif _no_split(model):
        blocks = _blocks_by_class(model, set(_no_split(model)))
        rule = f"model._no_split_modules {_no_split(model)}"
    else:
        blocks = _blocks_by_size(model, unit_min_bytes)
        rule = f"size rule (>= {unit_min_bytes} bytes per unit)"
    wanted_leaves = set(leaf_classes or ())
    leaves = _leaf_modules(model, wanted_leaves, auto_leaf_moe)
    missing_leaves = sorted(wanted_leaves - {type(m).__name__ for _, m in model.named_modules()})
    if missing_leaves:
        log.info("zero.leaf_modules: %s not in this model", missing_leaves)
    blocks, dynamic = _keep_leaves_whole(model, blocks, leaves, rule)

    # Which block holds each parameter directly, through every path that reaches it.
    block_of_path = {name: i for i, (name, _) in enumerate(blocks)}
    owners: dict[int, set[int | None]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        block = _enclosing_block(mname, block_of_path)
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(block)
    block_params: list[list[tuple[str, nn.Parameter]]] = [[] for _ in blocks]
    root_params: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for qname, p in model.named_parameters():  # deduplicates tied parameters
        if id(p) in seen:
            continue
        seen.add(id(p))
        where = owners.get(id(p), {None})
        only = next(iter(where))
        if len(where) == 1 and only is not None:
            block_params[only].append((qname, p))
        else:
            root_params.append((qname, p))  # outside every block, or tied across units
    specs = [
        UnitSpec(name, mod, tuple(params), is_root=False, dynamic=name in dynamic)
        for (name, mod), params in zip(blocks, block_params, strict=True)
        if params
    ]
    specs.append(UnitSpec("", model, tuple(root_params), is_root=True))
    log.info("units: %d blocks by %s (%d holding leaf modules), root unit holds %d "
             "parameters", len(specs) - 1, rule, len(dynamic), len(root_params))
    return specs


def check_parameters_supported(model: nn.Module) -> None:
    """Reject parameter layouts the flat shards cannot hold, naming the parameter."""
    for name, p in model.named_parameters():
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"parameter {name!r} has layout {p.layout}; only dense strided "
                             "parameters can be partitioned")
        if not p.dtype.is_floating_point:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; only floating-point "
                             "parameters can be partitioned")
