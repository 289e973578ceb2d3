"""`export_hf`: a live engine's model as a Hugging Face directory `from_pretrained` loads.

Streamed one flat group at a time ([Note: flat layout] in shards/flat.py): each
rank hands its shard (the fp32 `master` of trained groups, `param` of frozen ones
and of trained ones whose master it is: master_precision bf16) to an all-gather, rank 0
cuts the group's parameters out of the full buffer, writes them and drops it. Extra
memory: one group's full buffer and its parameters' copies (a unit's parameters of one
dtype; fp32 for trained groups), or, for a merged LoRA export, the unit's tensors until
its adapters are folded in.

Output (rank 0, into `<out>.partial`, renamed to `<out>` when complete):
    full model / merged LoRA:
        model.safetensors | model-0000i-of-0000N.safetensors + model.safetensors.index.json
        config.json                  the (base) model's config, dtype set to the written one
        generation_config.json       when the model has one
    LoRA adapter (train.export.lora: adapter): only the adapters are gathered
        adapter_model.safetensors    peft's key names (adapter name removed)
        adapter_config.json
    both: the tokenizer files of `tokenizer_from` (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, tokenizer.model, vocab.json, merges.txt, ...) when present.

Tensor names are the model's own (`named_parameters`, tied weights once, under
their first name, as `save_pretrained` does); a merged export uses the names the
model had before peft wrapped it. A collective: every rank calls it.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tierzero.engine.checkpoint.consolidate import DEFAULT_MAX_SHARD_BYTES, plan_shards
from tierzero.engine.checkpoint.io import (
    SafetensorsWriter,
    TensorEntry,
    fsync_dir,
    write_bytes_durable,
)
from tierzero.engine.checkpoint.layout import CheckpointError
from tierzero.engine.checkpoint.save import raise_if_any_failed, shard_use
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.hf.lora import adapter_parameters, base_name, is_peft_model
from tierzero.engine.shards.flat import FlatGroup
from tierzero.engine.unit import Unit

log = logging.getLogger(__name__)

LoraMode = Literal["adapter", "merged"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.txt", "spiece.model")


class ExportError(ValueError):
    """A model that cannot be exported as asked; names what and the way out."""


@dataclass(frozen=True)
class _Merge:
    """One peft lora.Linear: base weight + scaling * (B @ A), names in the wrapped model."""

    base: str
    a: str
    b: str
    scaling: float
    fan_in_fan_out: bool


def _merges(module: nn.Module) -> dict[str, _Merge]:
    """Every LoRA layer of `module` by its base weight's name; refuses what cannot fold."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    out: dict[str, _Merge] = {}
    for name, mod in module.named_modules():
        if not isinstance(mod, BaseTunerLayer):
            continue
        if not isinstance(mod, LoraLinear):
            raise ExportError(f"{name} is a {type(mod).__name__}: a merged export folds LoRA "
                              "on Linear layers only; set train.export.lora: adapter")
        adapters = list(mod.active_adapters)
        for ad in adapters:
            if getattr(mod, "use_dora", {}).get(ad) or getattr(mod, "lora_bias", {}).get(ad):
                raise ExportError(f"{name}: DoRA / LoRA bias cannot be merged here; set "
                                  "train.export.lora: adapter")
        if len(adapters) != 1:
            raise ExportError(f"{name} has {len(adapters)} active adapters {adapters}; a merged "
                              "export folds exactly one")
        ad = adapters[0]
        out[f"{name}.base_layer.weight"] = _Merge(
            f"{name}.base_layer.weight", f"{name}.lora_A.{ad}.weight",
            f"{name}.lora_B.{ad}.weight", float(mod.scaling[ad]), bool(mod.fan_in_fan_out))
    return out


class _ShardedOut:
    """Rank 0's safetensors files: entries declared up front, written in that order."""

    def __init__(self, directory: Path, entries: list[TensorEntry], max_bytes: int,
                 stem: str = "model") -> None:
        self.shards = plan_shards(entries, max_bytes) if entries else []
        n = len(self.shards)
        self.names = ([f"{stem}.safetensors"] if n == 1 else
                      [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.directory = directory
        self.stem = stem
        self._i = 0
        self._left = 0
        self._writer: SafetensorsWriter | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._writer is None:
            self._writer = SafetensorsWriter(self.directory / self.names[self._i],
                                             self.shards[self._i], {"format": "pt"})
            self._left = len(self.shards[self._i])
        self._writer.write(name, tensor)
        self._left -= 1
        if self._left == 0:
            self._writer.close()
            self._writer = None
            self._i += 1

    def finish(self) -> None:
        if self._i != len(self.shards):
            raise ExportError(f"internal: {len(self.shards) - self._i} safetensors files "
                              "left unfinished")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for s in self.shards for e in s)},
                     "weight_map": {e.name: f for f, s in zip(self.names, self.shards,
                                                             strict=True) for e in s}}
            write_bytes_durable(self.directory / f"{self.stem}.safetensors.index.json",
                                json.dumps(index, indent=2).encode())

    def abandon(self) -> None:
        if self._writer is not None:
            self._writer.__exit__(RuntimeError, None, None)
            self._writer = None


def is_hf_model(module: nn.Module) -> bool:
    """A Hugging Face model (or a peft wrapper of one): it has a config to write."""
    base = module.get_base_model() if is_peft_model(module) else module  # type: ignore[operator]
    return callable(getattr(getattr(base, "config", None), "to_json_string", None))


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(module.state_dict(keep_vars=True))
    return {n: b for n, b in module.named_buffers() if n in persistent}


def _config_json(model: nn.Module, dtype: torch.dtype) -> bytes:
    cfg = getattr(model, "config", None)
    if cfg is None or not callable(getattr(cfg, "to_json_string", None)):
        raise ExportError(f"{type(model).__name__} has no Hugging Face config (model.config); "
                          "only Hugging Face models can be exported for from_pretrained")
    data = json.loads(cfg.to_json_string())
    data["torch_dtype" if "torch_dtype" in data else "dtype"] = str(dtype).removeprefix("torch.")
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def _gather_group(eng: ZeroEngine, group: FlatGroup) -> torch.Tensor:
    """The group's full flat buffer (padded_numel elements, CPU): master or param."""
    kind = "master" if group.trainable and eng.store.has(group.key, "master") else "param"
    dev = eng.device if eng.comm.backend == "nccl" else torch.device("cpu")
    with shard_use(eng.store, group.key, kind) as shard:
        full = torch.empty(group.padded_numel, dtype=shard.dtype, device=dev)
        eng.comm.all_gather(full, shard.to(dev))
    return full.cpu()


def export_hf(eng: ZeroEngine, out: str | Path, *, dtype: torch.dtype | str = torch.float32,
              lora: LoraMode = "adapter", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              tokenizer_from: str | Path | None = None) -> Path:
    """Write the engine's model to the new directory `out` (see the module doc); returns it.

    `dtype`: fp32 / bf16 (or the torch dtype). `lora`: for a peft-wrapped model, the
    adapter alone or the base with the adapters merged. `tokenizer_from`: a directory
    whose tokenizer files are copied, or a tokenizer.json. Refuses, before any collective,
    an `out` that exists (exports are never overwritten) and a model without a Hugging
    Face config.
    """
    out_dtype = _checked_dtype(dtype, lora, max_shard_bytes)
    module = eng.module
    wrapped = is_peft_model(module)
    adapters = adapter_parameters(module)
    base_model = module.get_base_model() if wrapped else module  # type: ignore[operator]
    mode = "full" if not adapters else lora
    if mode == "adapter" and not wrapped:
        raise ExportError("the model has LoRA adapters but is not a peft PeftModel; set "
                          "train.export.lora: merged")
    config_bytes = _config_json(base_model, out_dtype) if mode != "adapter" else b""
    final = Path(out)
    if final.exists() or final.is_symlink():
        raise ExportError(f"export directory {final} already exists; exports are never "
                          "overwritten: pick another directory or remove it")
    eng.quiesce("export_hf")  # no optimizer thread writes a master shard after this

    rank0 = eng.comm.rank == 0
    temp = final.parent / f".{final.name}.partial"
    error = _make_partial_dir(final, temp) if rank0 else None
    _raise_if_any_failed(eng, error, final)

    merges = _merges(module) if mode == "merged" else {}
    target = _Target(mode, adapters, wrapped, out_dtype)
    groups = [(u, g) for u in eng.units for g in u.groups if mode != "adapter" or g.trainable]
    buffers = _buffers(module) if mode != "adapter" else {}
    entries = [TensorEntry(n, out_dtype, tuple(s.shape)) for _, g in groups for s in g.slots
               if (n := target.name(s.qname)) is not None]
    entries += [TensorEntry(target.name(n) or n,
                            out_dtype if b.is_floating_point() else b.dtype,
                            tuple(b.shape)) for n, b in buffers.items()]
    if rank0 and mode != "adapter":
        target.writer = _ShardedOut(temp, entries, max_shard_bytes)
    try:
        error = _stream_units(eng, groups, target, merges, temp=temp, error=error)
        if rank0 and error is None:
            try:
                target.write_buffers(buffers)
                _finish(temp, final, target.writer, kept=target.kept, module=module, mode=mode,
                        config_bytes=config_bytes, base_model=base_model,
                        tokenizer_from=tokenizer_from)
            except (OSError, ValueError) as exc:
                error = f"writing {temp}: {exc}"
    finally:
        if target.writer is not None and error is not None:
            target.writer.abandon()
    _raise_if_any_failed(eng, error, final)
    log.info("exported %s model to %s (%s)", mode, final, str(out_dtype).removeprefix("torch."))
    return final


def _checked_dtype(dtype: torch.dtype | str, lora: str, max_shard_bytes: int) -> torch.dtype:
    """export_hf's arguments checked; the torch dtype to write."""
    out_dtype = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if out_dtype is None or out_dtype not in DTYPES.values():
        raise ExportError(f"export dtype {dtype!r}; allowed: fp32, bf16")
    if lora not in ("adapter", "merged"):
        raise ExportError(f"export lora={lora!r}; allowed: adapter, merged")
    if max_shard_bytes <= 0:
        raise ExportError(f"max_shard_bytes={max_shard_bytes}; allowed: > 0")
    return out_dtype


def _make_partial_dir(final: Path, temp: Path) -> str | None:
    """Rank 0: a fresh, private `temp` beside `final`; the error text when it cannot."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if temp.exists():  # left by a killed export of this directory: ours to remove
            shutil.rmtree(temp)
        temp.mkdir(mode=0o700)
    except OSError as exc:
        return f"cannot create {temp} ({exc})"
    return None


class _Target:
    """What the export writes and under which names: every tensor in `mode` full or
    merged, the adapters alone (kept for peft's names) in adapter mode."""

    def __init__(self, mode: str, adapters: set[str], wrapped: bool,
                 dtype: torch.dtype) -> None:
        self.mode = mode
        self.adapters = adapters
        self.wrapped = wrapped
        self.dtype = dtype
        self.writer: _ShardedOut | None = None  # rank 0, full or merged: the files
        self.kept: dict[str, torch.Tensor] = {}  # adapter mode: the adapters (small)

    def name(self, qname: str) -> str | None:
        """The output name of the engine's parameter `qname`; None: not exported."""
        if self.mode == "adapter":
            return qname if qname in self.adapters else None
        if qname in self.adapters:
            return None
        return base_name(qname, self.wrapped) if self.wrapped else qname

    def emit(self, values: dict[str, torch.Tensor]) -> None:
        """Rank 0: `values` (engine names) to the files, or kept."""
        for qname, t in values.items():
            name = self.name(qname)
            if name is None:
                continue
            if self.mode == "adapter":
                self.kept[qname] = t.to(self.dtype)
            elif self.writer is not None:
                self.writer.write(name, t.to(self.dtype))

    def write_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Rank 0: the persistent buffers, after the parameters (floating ones in dtype)."""
        for n, b in buffers.items():
            if self.writer is not None:
                self.writer.write(self.name(n) or n,
                                  b.to(self.dtype) if b.is_floating_point() else b)


def _stream_units(eng: ZeroEngine, groups: list[tuple[Unit, FlatGroup]], target: _Target,
                  merges: dict[str, _Merge], *, temp: Path, error: str | None) -> str | None:
    """Gather `groups` unit by unit (a collective: every rank) and hand rank 0's values to
    `target`: at once, or with `merges` after the unit's adapters are folded in. Returns
    the first error (rank 0 keeps gathering after one, writing nothing more)."""
    rank0 = eng.comm.rank == 0
    for unit in eng.units:
        values: dict[str, torch.Tensor] = {}  # rank 0: this unit's parameters so far
        for u, g in groups:
            if u is not unit:
                continue
            full = _gather_group(eng, g)  # (padded_numel,) collective: every rank
            if rank0 and error is None:
                for s in g.slots:
                    values[s.qname] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
            del full
            if rank0 and error is None and not merges:  # nothing to fold: write now
                try:
                    target.emit(values)
                except (OSError, ValueError) as exc:
                    error = f"writing {temp}: {exc}"
                values = {}
        if not rank0 or error is not None or not values:
            continue
        try:  # a merged export: the unit's adapters fold into its base weights first
            _fold(values, merges, unit_name=unit.name)
            target.emit(values)
        except (OSError, ValueError) as exc:
            error = f"writing {temp}: {exc}"
    return error


def _raise_if_any_failed(eng: ZeroEngine, error: str | None, final: Path) -> None:
    """Collective: ExportError on every rank when one rank failed (none waits forever)."""
    try:
        raise_if_any_failed(eng, error, f"export_hf({str(final)!r})")
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None


def _fold(values: dict[str, torch.Tensor], merges: dict[str, _Merge], unit_name: str) -> None:
    """Fold every LoRA layer whose base weight is in `values` (one unit's tensors)."""
    for base, m in merges.items():
        if base not in values:
            continue
        if m.a not in values or m.b not in values:
            raise ExportError(f"LoRA weights {m.a} / {m.b} are not in the unit of {base} "
                              f"({unit_name!r}); set train.export.lora: adapter")
        delta = values[m.b].float() @ values[m.a].float() * m.scaling  # (out, in)
        w = values[base]
        values[base] = w.float() + (delta.T if m.fan_in_fan_out else delta)


def _finish(temp: Path, final: Path, writer: _ShardedOut | None, *,
            kept: dict[str, torch.Tensor], module: nn.Module, mode: str, config_bytes: bytes,
            base_model: nn.Module, tokenizer_from: str | Path | None) -> None:
    """Rank 0: index, config, adapter files, tokenizer; then publish `temp` as `final`."""
    if writer is not None:
        writer.finish()
    if mode == "adapter":
        _write_adapter(temp, kept, module)
    else:
        write_bytes_durable(temp / "config.json", config_bytes)
        gen = getattr(base_model, "generation_config", None)
        if gen is not None and callable(getattr(gen, "to_json_string", None)):
            write_bytes_durable(temp / "generation_config.json", gen.to_json_string().encode())
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        if src.is_file():  # a bare tokenizer.json
            write_bytes_durable(temp / "tokenizer.json", src.read_bytes())
        for name in TOKENIZER_FILES if src.is_dir() else ():
            if (src / name).is_file():
                write_bytes_durable(temp / name, (src / name).read_bytes())
    fsync_dir(temp)
    temp.rename(final)
    fsync_dir(final.parent)


def _write_adapter(temp: Path, kept: dict[str, torch.Tensor], module: Any) -> None:
    """adapter_model.safetensors + adapter_config.json, as PeftModel.save_pretrained writes."""
    peft = sys.modules["peft"]
    name = module.active_adapter
    sd = peft.get_peft_model_state_dict(module, state_dict=kept, adapter_name=name,
                                        save_embedding_layers=False)
    entries = [TensorEntry(k, v.dtype, tuple(v.shape)) for k, v in sd.items()]
    with SafetensorsWriter(temp / "adapter_model.safetensors", entries, {"format": "pt"}) as w:
        for k, v in sd.items():
            w.write(k, v)
    module.peft_config[name].save_pretrained(str(temp))  # adapter_config.json, peft's format
