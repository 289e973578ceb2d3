"""Reading a checkpoint directory: names, the manifest, integrity checks, shard ranges.

The layout is drawn in [Note: checkpoint layout] in engine/checkpoint/save.py,
the code that writes it. Everything here reads: resolve a tag, load and
check the manifest, verify each file's size and CRC-32 against it, and read
any element range of a group's full flat buffer from the rank files that
hold it (so consolidation and loading at another world size share one path).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tierzero.engine.checkpoint.io import ST_DTYPES, crc32, file_digest
from tierzero.offload.state_codec import StoredLayout

FORMAT = "tierzero-checkpoint"
VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
CLIENT_STATE = "client_state.pt"
HF_CONFIG = "hf_config.json"
BUFFER_PREFIX = "buffer::"
RNG_PREFIX = "rng::"
MANIFEST_CRC = "manifest_crc32"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file and the fix."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


# Shard kinds saved under another name by earlier versions: the compute-precision
# parameter shard was called "param16" (also under fp32 compute) until it became "param".
LEGACY_KINDS = {"param16": "param"}


def shard_name(key: str, kind: str) -> str:
    """Tensor name of a flat group's shard in a rank file (group keys hold '/')."""
    return f"{key}::{kind}"


def temp_dir_name(tag: str) -> str:
    return f".{tag}.partial"


def check_tag(tag: str) -> None:
    bad = not tag or tag.startswith(".") or any(c in tag for c in "/\\\0\n") or tag == LATEST
    if bad:
        raise ValueError(f"checkpoint tag {tag!r} is not allowed: use a non-empty name without "
                         f"'/', '\\', newlines or a leading '.', other than {LATEST!r}")


def resolve(directory: str | Path, tag: str | None) -> Path:
    """The directory of checkpoint `tag` (default: the one `latest` names), checked to exist."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise CheckpointError(f"{latest} is missing, so there is no complete checkpoint to "
                                  f"pick; pass tag= (present: {_tags(root)})")
        tag = latest.read_text().strip()
    check_tag(tag)
    path = root / tag
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path / MANIFEST} is missing: {tag!r} is not a complete "
                              f"checkpoint (complete ones in {root}: {_tags(root)})")
    return path


def _tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST).is_file())


@dataclass(frozen=True)
class GroupLayout:
    """One flat group as saved: its key, shard size and where each parameter sits."""

    key: str
    trainable: bool
    shard_numel: int
    numel: int  # unpadded
    params: tuple[tuple[str, tuple[int, ...], int, int], ...]  # (name, shape, offset, numel)
    kinds: tuple[str, ...]  # the shard kinds stored for this group (today's names)
    # How each rank's exp_avg / exp_avg_sq tensor is stored ([Note: compressed moments in
    # checkpoints]); None: no moments, or a checkpoint from before the field (fp32 then)
    moments: StoredLayout | None = None
    # kinds stored under an earlier name: (kind, name in the rank files)
    saved_as: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> dict[str, Any]:
        saved = dict(self.saved_as)
        out = {"key": self.key, "trainable": self.trainable, "shard_numel": self.shard_numel,
               "numel": self.numel, "kinds": [saved.get(k, k) for k in self.kinds],
               "params": [[n, list(s), o, c] for n, s, o, c in self.params]}
        if self.moments is not None:
            out["moments"] = self.moments.as_json()
        return out

    def tensor_name(self, kind: str) -> str:
        """The rank files' name of this group's `kind` shard (as it was saved)."""
        return shard_name(self.key, dict(self.saved_as).get(kind, kind))

    @staticmethod
    def from_json(d: dict[str, Any]) -> GroupLayout:
        moments = d.get("moments")
        return GroupLayout(d["key"], bool(d["trainable"]), int(d["shard_numel"]),
                           int(d["numel"]),
                           tuple((str(n), tuple(int(x) for x in s), int(o), int(c))
                                 for n, s, o, c in d["params"]),
                           tuple(LEGACY_KINDS.get(k, k) for k in d["kinds"]),
                           StoredLayout.from_json(moments) if moments is not None else None,
                           tuple((LEGACY_KINDS[k], k) for k in d["kinds"] if k in LEGACY_KINDS))

    def saved_moments(self) -> StoredLayout:
        """How the moment tensors are laid out in the rank files (fp32 when the manifest
        predates the field: older checkpoints held the moments decoded)."""
        return self.moments or StoredLayout.of("fp32", self.shard_numel)


def saved_layouts(path: Path, manifest: dict[str, Any]) -> list[GroupLayout]:
    """Every group's layout in checkpoint `path`'s manifest; one the codec cannot read (a
    moment block size or byte count it does not produce) is a CheckpointError naming the
    manifest and the group."""
    out = []
    for d in manifest["groups"]:
        try:
            out.append(GroupLayout.from_json(d))
        except ValueError as exc:
            raise CheckpointError(f"{path / MANIFEST}: group {d.get('key')!r}: {exc}") from exc
    return out


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """CRC-32 (8 hex digits) of the manifest's canonical JSON without its own checksum key.

    Canonical (sorted keys, no spaces) so that it covers every value, not the layout:
    one changed digit anywhere (a learning rate, a shard size, a file's CRC) changes it.
    """
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return f"{crc32(text.encode(), 0) & 0xFFFFFFFF:08x}"


def load_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path`, checked against its own CRC-32."""
    file = path / MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read as JSON ({exc}); the checkpoint is "
                              "damaged: load another tag") from exc
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file} is not a JSON object; the checkpoint is damaged: load "
                              "another tag")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r} version "
                              f"{manifest.get('version')!r}; this tierzero reads {FORMAT!r} "
                              f"version {VERSION}")
    want = manifest.get(MANIFEST_CRC)
    if want is None:
        raise CheckpointError(f"{file} has no {MANIFEST_CRC!r}, so its values cannot be "
                              "checked (written by an older tierzero, or edited): load another "
                              "tag, or re-save the checkpoint with this version")
    got = manifest_checksum(manifest)
    if got != want:
        raise CheckpointError(f"{file} is corrupted or was edited: CRC-32 of its contents is "
                              f"{got}, its {MANIFEST_CRC} says {want}; load another tag")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], names: list[str] | None = None) -> None:
    """Check size, then CRC-32, of the named files (default all) against the manifest."""
    files: dict[str, dict[str, int]] = manifest["files"]
    for name in names if names is not None else sorted(files):
        want = files.get(name)
        if want is None:
            raise CheckpointError(f"{path / name} is not listed in {path / MANIFEST}")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in the manifest with "
                                  f"{want['bytes']} bytes); the checkpoint is incomplete")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{file} is {size} bytes, the manifest says {want['bytes']}: "
                                  "the file is truncated or was changed; load another tag")
        got = file_digest(file)
        if got.crc32 != want["crc32"]:
            raise CheckpointError(f"{file} is corrupted: CRC-32 {got.crc32:08x}, the manifest "
                                  f"says {want['crc32']:08x}; load another tag")


class RankFiles:
    """Open rank files of one checkpoint; reads element ranges of full flat buffers.

    Full buffer of a group = concatenation of the saved ranks' shards
    ([Note: flat layout] in engine/shards/flat.py); a range past the saved
    padding reads as zeros (padding is zero by construction).
    """

    def __init__(self, path: Path, world_size: int) -> None:
        self.path = path
        self.world_size = world_size
        self._open: dict[int, Any] = {}
        self._names: dict[int, list[str]] = {}
        self._headers: dict[int, tuple[Any, int, dict[str, Any]]] = {}

    def handle(self, rank: int) -> Any:
        h = self._open.get(rank)
        if h is None:
            file = self.path / rank_file(rank)
            try:
                h = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own types for bad headers
                raise CheckpointError(f"{file} cannot be opened as safetensors ({exc}); the "
                                      "file is damaged: load another tag") from exc
            self._open[rank] = h
        return h

    def names(self, rank: int) -> list[str]:
        names = self._names.get(rank)
        if names is None:
            keys: list[str] = self.handle(rank).keys()  # safe_open is not iterable
            names = self._names[rank] = list(keys)
        return names

    def tensor(self, rank: int, name: str) -> torch.Tensor:
        try:
            t: torch.Tensor = self.handle(rank).get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"{self.path / rank_file(rank)}: cannot read tensor "
                                  f"{name!r} ({exc})") from exc
        return t

    def _header(self, rank: int) -> tuple[Any, int, dict[str, Any]]:
        """(open file, data start, header) of a rank file; see the safetensors format."""
        got = self._headers.get(rank)
        if got is None:
            file = self.path / rank_file(rank)
            f = open(file, "rb", buffering=0)  # noqa: SIM115 (closed in close())
            try:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            except (ValueError, OSError) as exc:
                f.close()
                raise CheckpointError(f"{file}: unreadable safetensors header ({exc})") from exc
            got = self._headers[rank] = (f, 8 + n, header)
        return got

    def read_into(self, rank: int, name: str, out: torch.Tensor) -> None:
        """Read tensor `name` of rank `rank` straight into `out` (same dtype and numel) with
        one read call: faster than copying from the memory map, which faults page by page."""
        f, start, header = self._header(rank)
        entry = header.get(name)
        file = self.path / rank_file(rank)
        if entry is None:
            raise CheckpointError(f"{file} has no tensor {name!r}")
        lo, hi = entry["data_offsets"]
        nbytes = out.numel() * out.element_size()
        if entry["dtype"] != ST_DTYPES.get(out.dtype) or hi - lo != nbytes:
            raise CheckpointError(f"{file}: {name!r} is {entry['dtype']} {entry['shape']}, "
                                  f"expected {out.dtype} with {out.numel()} elements")
        direct = out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(out.shape, dtype=out.dtype)
        view = target.reshape(-1).view(torch.uint8).numpy().data
        got = os.preadv(f.fileno(), [view], start + lo) if hi > lo else 0
        if got != hi - lo:
            raise CheckpointError(f"{file}: {name!r} read {got} of {hi - lo} bytes; the file "
                                  "is truncated")
        if not direct:
            out.copy_(target)

    def read_range(self, group: GroupLayout, kind: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of `group`'s full `kind` buffer, 1D, saved dtype."""
        s = group.shard_numel
        pieces: list[torch.Tensor] = []
        pos = start
        saved_end = s * self.world_size
        while pos < min(stop, saved_end):
            rank = pos // s
            hi = min(stop, (rank + 1) * s)
            name = group.tensor_name(kind)
            try:
                sl = self.handle(rank).get_slice(name)
                pieces.append(sl[pos - rank * s:hi - rank * s])
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{self.path / rank_file(rank)}: cannot read "
                                      f"{name!r} [{pos - rank * s}:{hi - rank * s}] ({exc})"
                                      ) from exc
            pos = hi
        if pos < stop:
            dtype = pieces[0].dtype if pieces else torch.float32
            pieces.append(torch.zeros(stop - pos, dtype=dtype))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def read_moment_range(self, group: GroupLayout, kind: str, start: int,
                          stop: int) -> torch.Tensor:
        """Elements [start, stop) of moment `kind`'s full buffer decoded to fp32: each saved
        piece that holds some of them is read whole and decoded ([Note: stored moment
        layout] in offload/state_codec.py); past the saved padding, zeros."""
        lay = group.saved_moments()
        if lay.precision == "fp32":
            return self.read_range(group, kind, start, stop)
        s = group.shard_numel
        out = torch.zeros(stop - start, dtype=torch.float32)
        name = group.tensor_name(kind)
        for rank in range(start // s, min(self.world_size, -(-stop // s))):
            base = rank * s
            for lo, hi, a, b in lay.pieces():
                lo_, hi_ = max(base + lo, start), min(base + hi, stop)
                if lo_ >= hi_:
                    continue
                try:
                    sl = self.handle(rank).get_slice(name)
                    shape = list(sl.get_shape())
                    if shape != [lay.stored_numel]:
                        raise ValueError(f"shape {shape}, the manifest's layout "
                                         f"{lay.describe()} needs [{lay.stored_numel}]")
                    raw = sl[a:b]
                except CheckpointError:
                    raise
                except Exception as exc:
                    raise CheckpointError(f"{self.path / rank_file(rank)}: cannot read "
                                          f"{name!r} bytes [{a}:{b}] ({exc})") from exc
                piece = torch.empty(hi - lo, dtype=torch.float32)
                StoredLayout.of(lay.precision, hi - lo).decode(kind, raw, piece)
                out[lo_ - start:hi_ - start] = piece[lo_ - base - lo:hi_ - base - lo]
        return out

    def close(self) -> None:
        self._open.clear()
        self._names.clear()
        for f, _, _ in self._headers.values():
            f.close()
        self._headers.clear()


def shard_numel_for(numel: int, world_size: int, align: int) -> int:
    """The shard size shards.flat.build_group picks for `numel` elements over `world_size`."""
    chunk = align * world_size
    return max(chunk, math.ceil(numel / chunk) * chunk) // world_size
