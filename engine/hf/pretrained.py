"""`engine.load_pretrained`: stream a Hugging Face checkpoint into the shards.

Each parameter is written where its values live now, this rank's part only:
- partitioned by an engine: this rank's slice of the unit's flat buffer
  ([Note: flat layout] in shards/flat.py), into `param` and the fp32 master;
- partitioned by `engine.Init`: this rank's slice of the parameter
  ([Note: Init partitioning] in init/context.py);
- not partitioned: the whole parameter (module buffers likewise).
Every rank reads only the rows of each tensor that hold its slice, one tensor
at a time, so the extra memory is bounded by the largest tensor. No
collective runs, so ranks need not agree on anything but the files.

A peft-wrapped model (LoRA) loads the checkpoint of the model it wraps: keys
are matched to the wrapped names and the adapters keep their initial values.

Everything is checked before any value is written: every parameter present
under one of its names (tied parameters have several), no unknown key, every
shape equal, no truncated file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tierzero.engine.access import owner_of
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.hf.layouts import map_legacy_moe
from tierzero.engine.hf.lora import peft_aliases
from tierzero.engine.hf.weights import (
    PretrainedLoadError,
    SliceReader,
    TensorEntry,
    checkpoint_files,
    iter_ranges,
    list_tensors,
)
from tierzero.engine.init.context import local_slice
from tierzero.engine.schedule import Scheduler
from tierzero.engine.shards.flat import FlatGroup, ParamSlot
from tierzero.engine.shards.store import ShardStore

log = logging.getLogger(__name__)

_Params = list[tuple[TensorEntry, nn.Parameter]]  # checkpoint entry -> parameter it fills
_Buffers = list[tuple[TensorEntry, str]]  # checkpoint entry -> qualified buffer name


@dataclass(frozen=True)
class LoadReport:
    files: list[str]
    tensors: int  # tensors written (aliases of a tied parameter counted once)
    bytes_read: int  # in the files' dtypes, this rank
    peak_read_bytes: int  # largest single read: the extra memory bound


def _alias_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _engine_slots(module: nn.Module) -> dict[int, tuple[FlatGroup, ParamSlot]]:
    """Parameters an engine partitioned: id -> (group, slot)."""
    out: dict[int, tuple[FlatGroup, ParamSlot]] = {}
    for p in module.parameters():
        owner = owner_of(p)
        if owner is None:
            continue
        for g in owner.unit.groups:
            for s in g.slots:
                if s.param is p:
                    out[id(p)] = (g, s)
    return out


def _align_prefix(module: nn.Module, tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Checkpoint keys in the module's naming. A Hugging Face checkpoint of the base model
    (`layers.0...`) loads into the model with a head (`model.layers.0...`) and the other
    way round: the variant (as is, `base_model_prefix.` added, or removed) that matches
    the most parameter and buffer names wins, applied to every key alike."""
    prefix = getattr(module, "base_model_prefix", "")
    if not isinstance(prefix, str) or not prefix:
        return tensors
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    names |= {n for n, _ in module.named_buffers()}
    p = prefix + "."
    variants = {
        "as is": dict(tensors),
        "added": {p + k: e for k, e in tensors.items()},
        "removed": {k.removeprefix(p): e for k, e in tensors.items()},
    }
    best = max(variants, key=lambda v: (len(names & set(variants[v])), v == "as is"))
    if best != "as is":
        log.info("load_pretrained: checkpoint keys %s the model's base_model_prefix %r",
                 best, prefix)
    return variants[best]


def _peft_names(module: nn.Module, tensors: dict[str, TensorEntry]
                ) -> tuple[dict[str, TensorEntry], set[str]]:
    """Checkpoint keys in a peft-wrapped model's naming (engine/hf/lora.py): a Hugging Face
    checkpoint of the unwrapped model fills the frozen base (`...q_proj.base_layer.weight`
    from `...q_proj.weight`); the adapters (returned second) are new, never 'missing'."""
    aliases, adapters = peft_aliases(module)
    if not aliases:
        return tensors, adapters
    out = dict(tensors)
    used = set()
    for name, original in aliases.items():
        if original in tensors and name not in tensors:
            out[name] = tensors[original]
            used.add(original)
    for original in used:
        out.pop(original, None)
    log.info("load_pretrained: %d checkpoint keys matched to the peft-wrapped model's names; "
             "%d adapter parameters keep their initial values", len(used), len(adapters))
    return out, adapters


def _check(module: nn.Module, tensors: dict[str, TensorEntry], strict: bool,
           slots: dict[int, tuple[FlatGroup, ParamSlot]],
           fresh: set[str] | None = None) -> tuple[_Params, _Buffers]:
    """Match checkpoint keys to parameters and buffers; every problem is raised at once."""
    by_name = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers())
    matched: list[tuple[TensorEntry, nn.Parameter]] = []
    buf_matched: list[tuple[TensorEntry, str]] = []
    missing, mismatched = [], []
    for pid, names in _alias_names(module).items():
        hits = [n for n in names if n in tensors]
        if not hits:
            if not fresh or not set(names) & fresh:
                missing.append(names[0])
            continue
        p = by_name[hits[0]]
        hit = slots.get(pid)
        shape = tuple(hit[1].shape if hit is not None else p.shape)  # engine: true shape
        for n in hits:
            if tensors[n].shape != shape:
                mismatched.append(f"{n!r} in {tensors[n].file.name}: file {list(tensors[n].shape)}"
                                  f", model {list(shape)}")
        if id(p) != pid:
            raise RuntimeError("internal: alias table out of step")
        matched.append((tensors[hits[0]], p))
    for n, b in buffers.items():
        if n in tensors:
            if tensors[n].shape != tuple(b.shape):
                mismatched.append(f"{n!r} (buffer) in {tensors[n].file.name}: file "
                                  f"{list(tensors[n].shape)}, model {list(b.shape)}")
            buf_matched.append((tensors[n], n))
    unexpected = sorted(set(tensors) - set(by_name) - set(buffers))
    problems = []
    if mismatched:
        problems.append(f"shape mismatch for {len(mismatched)} tensors: " + "; ".join(
            mismatched[:10]))
    if missing and strict:
        problems.append(f"{len(missing)} parameters missing from the checkpoint: "
                        f"{missing[:10]}")
    if unexpected and strict:
        where = {tensors[n].file.name for n in unexpected}
        problems.append(f"{len(unexpected)} unexpected keys (in {sorted(where)}): "
                        f"{unexpected[:10]}")
    if problems:
        raise PretrainedLoadError(
            "checkpoint does not fit the model: " + " | ".join(problems) +
            ". Build the model from the checkpoint's own config; pass strict=False to "
            "skip missing and unexpected keys (shapes must always match)")
    if missing or unexpected:
        log.warning("load_pretrained(strict=False): %d parameters not in the checkpoint "
                    "(kept as initialised): %s; %d checkpoint keys not used: %s",
                    len(missing), missing[:10], len(unexpected), unexpected[:10])
    return matched, buf_matched


def _write_engine_slot(reader: SliceReader, entry: TensorEntry, eng_group: FlatGroup,
                       slot: ParamSlot, *, rank: int, store: ShardStore) -> int:
    lo, hi = rank * eng_group.shard_numel, (rank + 1) * eng_group.shard_numel
    a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
    if b <= a:
        return 0
    values = reader.read(entry, a - slot.offset, b - slot.offset)
    # Through store.use: a shard homed in the tier manager (offloaded to host or NVMe) is
    # fetched, written and released (written back) like any other update.
    with store.use(eng_group.key, "param", writable=True) as param:
        param[a - lo:b - lo].copy_(values)
    if eng_group.trainable and store.has(eng_group.key, "master"):  # (none if bf16)
        # exact: the file's values, not param's (an fp32 master aliasing param gets
        # the same values twice)
        with store.use(eng_group.key, "master", writable=True) as master:
            master[a - lo:b - lo].copy_(values)
    return values.numel() * values.element_size()


def load_pretrained(model_or_engine: nn.Module | ZeroEngine, path: str | Path, *,
                    strict: bool = True) -> LoadReport:
    """Load a Hugging Face checkpoint directory (or one weight file) into the model.

    Reads `model.safetensors.index.json` / `pytorch_model.bin.index.json` when
    present, else `model.safetensors` / `pytorch_model.bin`, else every
    `*.safetensors`. Works before `engine.initialize` (on an `engine.Init`
    build or a plain module) and after it (pass the engine or its module).
    Raises PretrainedLoadError, before writing anything, for a missing or
    unexpected key (unless strict=False), a shape mismatch, or a truncated or
    unreadable file, naming the tensor and the file.
    """
    module = model_or_engine.module if isinstance(model_or_engine, ZeroEngine) else model_or_engine
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_pretrained needs an nn.Module or a ZeroEngine; got "
                        f"{type(model_or_engine).__name__}")
    files = checkpoint_files(Path(path))
    with torch.no_grad(), SliceReader() as reader:
        tensors, fresh = _peft_names(module, list_tensors(files, reader))
        tensors = _align_prefix(module, tensors)
        tensors = map_legacy_moe({n for n, _ in module.named_parameters()}, tensors)
        slots = _engine_slots(module)
        matched, buf_matched = _check(module, tensors, strict, slots, fresh)
        param_of = {id(e): p for e, p in matched}
        total = 0
        stale: list[Scheduler] = []  # engines whose gathered copies predate the new values
        for entry in iter_ranges([e for e, _ in matched]):
            p = param_of[id(entry)]
            hit = slots.get(id(p))
            owner = owner_of(p)
            if hit is not None and owner is not None:
                group, slot = hit
                owner.scheduler.wait_updates(owner.unit)  # a deferred optimizer update first
                total += _write_engine_slot(reader, entry, group, slot,
                                            rank=owner.scheduler.comm.rank,
                                            store=owner.scheduler.store)
                if owner.unit.gathered:
                    owner.unit.mark_stale()  # its gathered copy predates the new values
                    stale.append(owner.scheduler)
                continue
            with local_slice(p) as part:  # written back to NVMe on exit when it lives there
                if part is not None:
                    shard, first = part
                    n = min(shard.numel(), max(0, entry.numel - first))
                    if n:
                        values = reader.read(entry, first, first + n)
                        shard[:n].copy_(values)
                        total += values.numel() * values.element_size()
            if part is not None:
                continue
            values = reader.read(entry, 0, entry.numel)
            p.copy_(values.view(p.shape))
            total += values.numel() * values.element_size()
        for entry, name in buf_matched:
            owner_mod, _, attr = name.rpartition(".")
            mod = module.get_submodule(owner_mod)
            buf = mod._buffers[attr]
            if buf is not None:
                buf.copy_(reader.read(entry, 0, entry.numel).view(buf.shape))
        peak = reader.peak_read_bytes
    for sched in stale:  # each rank loads on its own: released locally, gathered by the next
        sched.drop_stale()  # forward ([Note: persistent units after the step])
    log.info("load_pretrained: %d tensors from %d files, %d bytes read on this rank "
             "(largest read %d bytes)", len(matched), len(files), total, peak)
    return LoadReport([str(f) for f in files], len(matched), total, peak)
