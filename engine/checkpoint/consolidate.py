"""Whole parameters from a checkpoint's shards: `consolidate()` and safetensors output.

Layout read: [Note: checkpoint layout] in engine/checkpoint/save.py. A parameter
is cut from its group's full flat buffer, which is read range by range from
the rank files that hold it ([Note: flat layout]), so one tensor at a time is
in memory: `consolidate_to_safetensors` never holds more than the largest
parameter (plus the rank files' memory maps). Trainable parameters come from
the fp32 `master` shards (from `param` where it is the master: master_precision
bf16); frozen ones from `param` (their only copy).

Output (Hugging Face convention, what `from_pretrained` reads):
    model.safetensors                        when everything fits in max_shard_bytes
    model-00001-of-0000N.safetensors ...     otherwise, plus
    model.safetensors.index.json             {"metadata": {"total_size": B},
                                              "weight_map": {name: file}}
    config.json                              when the checkpoint holds the model's HF config
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierzero.engine.checkpoint.io import (
    SafetensorsWriter,
    TensorEntry,
    fsync_dir,
    write_bytes_durable,
)
from tierzero.engine.checkpoint.layout import (
    BUFFER_PREFIX,
    HF_CONFIG,
    GroupLayout,
    RankFiles,
    load_manifest,
    resolve,
    saved_layouts,
    verify_files,
)
from tierzero.swap.safe_files import make_output_dir

log = logging.getLogger(__name__)

OUT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # the transformers save_pretrained default ("5GB")


@dataclass(frozen=True)
class _Item:
    name: str
    shape: tuple[int, ...]
    group: GroupLayout | None  # None: a module buffer (rank 0's copy)
    offset: int
    numel: int


class _Source:
    """The tensors of one checkpoint, in model order, read one at a time."""

    def __init__(self, directory: str | Path, tag: str | None, verify: bool) -> None:
        self.path = resolve(directory, tag)
        self.manifest = load_manifest(self.path)
        if verify:
            verify_files(self.path, self.manifest)
        self.files = RankFiles(self.path, int(self.manifest["world_size"]))
        self.items: list[_Item] = []
        for g in saved_layouts(self.path, self.manifest):
            self.items += [_Item(n, s, g, o, c) for n, s, o, c in g.params]
        h = self.files.handle(0)
        for key in self.files.names(0):
            if key.startswith(BUFFER_PREFIX):
                shape = tuple(h.get_slice(key).get_shape())
                self.items.append(_Item(key.removeprefix(BUFFER_PREFIX), shape, None, 0, 0))
        order = {n: i for i, n in enumerate(self.manifest.get("order", []))}
        self.items.sort(key=lambda it: order.get(it.name, len(order)))  # model order

    def dtype_of(self, item: _Item, out: torch.dtype) -> torch.dtype:
        if item.group is None:  # buffers keep their dtype unless floating
            dt = self.files.tensor(0, BUFFER_PREFIX + item.name).dtype
            return out if dt.is_floating_point else dt
        return out

    def read(self, item: _Item, out: torch.dtype) -> torch.Tensor:
        if item.group is None:
            t = self.files.tensor(0, BUFFER_PREFIX + item.name)
            return t.to(out) if t.is_floating_point() else t
        # a bf16 master is the param ([Note: master precision in checkpoints] in load.py)
        kind = "master" if item.group.trainable and "master" in item.group.kinds else "param"
        flat = self.files.read_range(item.group, kind, item.offset, item.offset + item.numel)
        return flat.to(out).reshape(item.shape)

    def close(self) -> None:
        self.files.close()


def consolidate(directory: str | Path, tag: str | None = None, *,
                dtype: torch.dtype = torch.float32, verify: bool = True,
                buffers: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict (parameter name -> tensor, in `dtype`) of checkpoint `tag`
    (default: `latest`). Holds the whole model: for large models use
    `consolidate_to_safetensors`, which streams."""
    src = _Source(directory, tag, verify)
    try:
        return {it.name: src.read(it, dtype) for it in src.items
                if buffers or it.group is not None}
    finally:
        src.close()


def plan_shards(entries: list[TensorEntry], limit: int) -> list[list[TensorEntry]]:
    """`entries` cut, in order, into safetensors files of at most `limit` bytes each (a
    tensor larger than `limit` alone in its file)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def consolidate_to_safetensors(directory: str | Path, out: str | Path, tag: str | None = None,
                               *, dtype: torch.dtype = torch.float32,
                               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                               verify: bool = True, progress: bool | None = None) -> list[Path]:
    """Write checkpoint `tag` (default `latest`) as Hugging Face safetensors under `out`,
    tensor by tensor. Returns the files written (index last when sharded). `progress`:
    a tqdm bar (None: only on a terminal)."""
    if dtype not in OUT_DTYPES.values():
        raise ValueError(f"consolidate dtype {dtype} is not one of fp32, bf16")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}; must be > 0")
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"consolidate output {str(out_dir)!r} exists and is not a directory")
    src = _Source(directory, tag, verify)
    try:
        entries = [TensorEntry(it.name, src.dtype_of(it, dtype), it.shape) for it in src.items]
        items = {it.name: it for it in src.items}
        shards = plan_shards(entries, max_shard_bytes)
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                  for i in range(len(shards))])
        make_output_dir(out_dir)  # 0700 when new; files are created 0600 ([Note: output files])
        total = sum(e.nbytes for e in entries)
        written: list[Path] = []
        with tqdm(total=total, unit="B", unit_scale=True, desc="consolidate",
                  disable=None if progress is None else not progress) as bar:
            for fname, shard in zip(names, shards, strict=True):
                with SafetensorsWriter(out_dir / fname, shard, {"format": "pt"}) as w:
                    for e in shard:  # one tensor alive at a time: read, written, dropped
                        w.write(e.name, src.read(items[e.name], dtype))
                        bar.update(e.nbytes)
                written.append(out_dir / fname)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.name: n for n, s in zip(names, shards, strict=True)
                                    for e in s}}
            idx = out_dir / "model.safetensors.index.json"
            write_bytes_durable(idx, json.dumps(index, indent=2).encode())
            written.append(idx)
        if HF_CONFIG in src.manifest["files"]:
            cfg = out_dir / "config.json"
            write_bytes_durable(cfg, (src.path / HF_CONFIG).read_bytes())
            written.append(cfg)
        fsync_dir(out_dir)
    finally:
        src.close()
    log.info("consolidated %s into %d file(s) under %s", src.path, len(written), out_dir)
    return written

