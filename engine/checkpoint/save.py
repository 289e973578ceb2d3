"""`ZeroEngine.save_checkpoint`: every rank streams its shards to disk; rank 0 publishes.

[Note: checkpoint layout]

    <dir>/
      latest                     text: the tag of the newest complete checkpoint; replaced
                                 atomically, and only after that checkpoint is durable
      .<tag>.partial/            a save in progress (or killed): never read, removed by the
                                 next save of the same tag
      <tag>/                     a complete checkpoint: the .partial directory, renamed
        manifest.json            written last inside .partial, by rank 0: format, version,
                                 tag, world size, compute dtype, every flat group's layout
                                 (key, shard size, parameter names/shapes/offsets, stored
                                 kinds, the moments' stored layout), the model's parameter
                                 order, engine state, config,
                                 each file's bytes + CRC-32, and "manifest_crc32": the
                                 CRC-32 of all of that (checkpoint_layout.manifest_checksum)
        rank00000.safetensors    rank r's shards, one tensor per (group, kind), named
        rank00001.safetensors    "<group key>::<kind>" (1D, shard_numel elements):
        ...                        trainable: master (param with master_precision bf16),
                                   exp_avg, exp_avg_sq (fp32, or their stored bytes with
                                   state_precision bf16 / int8: [Note: compressed moments
                                   in checkpoints]), grad only when saved mid-accumulation,
                                   optim.<name> for other per-element state; frozen: param.
                                 "rng::torch" / "rng::cuda" (uint8 RNG states); rank 0 also
                                 "buffer::<name>" (module buffers). Header metadata
                                 "tierzero": JSON with this rank's optimizer scalars
                                 (per group) and python/numpy RNG states.
        client_state.pt          client_state of save_checkpoint, rank 0's (torch.save;
                                 loaded with weights_only=True)
        hf_config.json           the model's Hugging Face config when it has one (consolidate
                                 writes it as config.json)

Crash safety: files are written under .partial and fsynced; the manifest
(holding every file's size and CRC-32) is written and fsynced after all ranks
finished; the directory is renamed to <tag> and the parent fsynced; only then
is `latest` replaced (temp file, fsync, rename, fsync). A kill at any point
leaves `latest` naming the previous complete checkpoint. Load checks each
file's size and CRC-32 before using it. One shared file system is assumed
for all ranks (every rank writes into the same directory).

[Note: compressed moments in checkpoints]
With offload.optimizer.state_precision bf16 / int8 the moments are kept compressed
(offload/state_codec.py). A checkpoint stores them as they are kept: each rank's
"<key>::exp_avg" / "::exp_avg_sq" is the store's bytes (uint8, the pieces' bytes in
order, streamed one shard at a time through `ShardStore.use_stored`, no decoding), and the
group's "moments" entry in the manifest gives the layout ([Note: stored moment layout] in
offload/state_codec.py: precision, numel, piece_numel, block, nbytes), enough to decode
without the run's config; the manifest's "state_precision" says how the run kept them.
fp32 moments are written as before (float32, "moments" precision fp32).
Load copies the bytes as they are when the layout is this run's and the world size is
the saved one (bit-exact resume). Otherwise the moments are decoded (state_codec, exact)
and the store encodes them in its own layout, logged once: into fp32 that is exact, bf16
resliced to another world size is exact (element-wise), int8 at other block boundaries
(another world size or piece size) and a coarser precision are rounded once.
A checkpoint whose groups have no "moments" entry (written before this format) holds the
moments decoded to fp32 whatever its "state_precision" says: they load as fp32 moments
(encoded again by a compressing run: the same bytes where its blocks start where the
saving run's did).
`consolidate` reads master / param only: the moments' format does not concern it.

Parameter names and the flat layout follow [Note: flat layout] in
engine/shards/flat.py; group keys are `FlatGroup.key`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tierzero.engine.checkpoint.background import (
    SYNC_EVERY,
    Pacer,
    SaveStats,
    write_snapshot_entry,
)
from tierzero.engine.checkpoint.deferred import capture_deferred
from tierzero.engine.checkpoint.io import (
    SafetensorsWriter,
    TensorEntry,
    fsync_dir,
    replace_durable,
    write_bytes_durable,
)
from tierzero.engine.checkpoint.layout import (
    BUFFER_PREFIX,
    CLIENT_STATE,
    FORMAT,
    HF_CONFIG,
    LATEST,
    MANIFEST,
    MANIFEST_CRC,
    VERSION,
    CheckpointError,
    GroupLayout,
    check_tag,
    manifest_checksum,
    rank_file,
    shard_name,
    temp_dir_name,
)
from tierzero.engine.checkpoint.state import (
    OPTIM_PREFIX,
    engine_state,
    hf_config_json,
    persistent_buffers,
    rng_state,
)
from tierzero.engine.config.native import as_dict
from tierzero.engine.progress import progress_bar, progress_enabled
from tierzero.engine.shards.snapshot import Part, StoreSnapshot
from tierzero.engine.shards.store import ShardStore
from tierzero.offload import OffloadError, SnapshotSpaceError
from tierzero.offload.settings import MOMENT_CLASSES
from tierzero.swap.safe_files import OutputModes, make_output_dir, output_modes

if TYPE_CHECKING:
    from tierzero.engine.checkpoint.background import BackgroundSaver, PendingSave
    from tierzero.engine.engine import ZeroEngine

log = logging.getLogger(__name__)


@contextmanager
def shard_use(store: ShardStore, key: str, kind: str, *, writable: bool = False,
              overwrite: bool = False) -> Iterator[torch.Tensor]:
    """A shard tensor for the duration of the block, through the store's own access path
    (a tiered store fetches and releases around the block, [Note: shard residency]), on
    its home tier (host for NVMe), not gathered: `compute=False`. `overwrite=True`: the
    block writes every element, so a tiered store need not read the old bytes from NVMe."""
    with store.use(key, kind, writable=writable or overwrite,  # type: ignore[arg-type]
                   compute=False, overwrite=overwrite) as t:
        yield t


@dataclass(frozen=True)
class ShardRef:
    """A shard written straight from the store at write time (no copy): key, kind, layout;
    `stored`: a moment, written in its stored form (`ShardStore.use_stored`)."""

    key: str
    kind: str
    dtype: torch.dtype
    numel: int
    stored: bool = False

    def use(self, store: ShardStore) -> AbstractContextManager[torch.Tensor]:
        if self.stored:
            return store.use_stored(self.key, self.kind)  # type: ignore[arg-type]
        return shard_use(store, self.key, self.kind)


@dataclass(frozen=True)
class SnapRef:
    """A shard a background save's writer takes from the store's snapshot, part by part
    ([Note: snapshot parts] in engine/shards/snapshot.py): dtype and numel as saved."""

    dtype: torch.dtype
    numel: int
    parts: tuple[Part, ...]


def gather_objects(eng: ZeroEngine, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a collective on the engine's group)."""
    return _gather(eng.comm.group, eng.comm.world_size, value)


def _gather(group: dist.ProcessGroup | None, world: int, value: Any) -> list[Any]:
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _raise_if_failed(group: dist.ProcessGroup | None, world: int, error: str | None,
                     what: str) -> None:
    errors = [(r, e) for r, e in enumerate(_gather(group, world, error)) if e is not None]
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise CheckpointError(f"{what} failed on {len(errors)} rank(s): {detail}")


def raise_if_any_failed(eng: ZeroEngine, error: str | None, what: str) -> None:
    """Collective: every rank raises when one rank failed, so no rank waits forever."""
    _raise_if_failed(eng.comm.group, eng.comm.world_size, error, what)


def group_layouts(eng: ZeroEngine, with_grad: bool) -> list[GroupLayout]:
    """Every flat group's layout; a trainable group's kinds: its master (or param), the moments the
    step driver keeps in the store (its state_dict's shards), its gradient `with_grad`."""
    optim = eng.step_driver.state_dict()["state"]
    out = []
    for unit in eng.units:
        for g in unit.groups:
            if g.trainable:
                kinds = (["master"] if eng.store.has(g.key, "master") else ["param"]) + list(
                    optim[g.key].shards) + (["grad"] if with_grad and eng.store.has(
                        g.key, "grad") else [])
            else:
                kinds = ["param"]
            params = tuple((s.qname, tuple(s.shape), s.offset, s.numel) for s in g.slots)
            moments = next((eng.store.moment_layout(g.key, k)
                            for k in kinds if k in MOMENT_CLASSES), None)
            out.append(GroupLayout(g.key, g.trainable, g.shard_numel, g.numel, params,
                                   tuple(kinds), moments))
    return out


@dataclass
class RankPayload:
    """Everything one rank writes, captured at save time: after this, training may go on."""

    tensors: list[tuple[str, torch.Tensor | ShardRef | SnapRef]]  # CPU copies, or refs
    metadata: dict[str, str]
    store: Any  # where ShardRefs are read (None in a snapshot)
    manifest: dict[str, Any]  # rank 0: the manifest without "files"
    client_bytes: bytes | None
    progress: bool = False  # a progress bar while writing (engine.progress rule)
    snapshot: StoreSnapshot | None = None  # where SnapRefs are read ([Note: background save])
    share: float = 1.0  # outputs.background_save_share: the writer's Pacer

    def snapshot_keys(self) -> list[str]:
        return [p[0] for _, t in self.tensors if isinstance(t, SnapRef) for p in t.parts]


def _collect(eng: ZeroEngine, layouts: list[GroupLayout], client_bytes: bytes | None,
             snapshot: bool) -> RankPayload:
    """What this rank writes: shards as references the writer streams from the store (a
    synchronous save), or, for a background save (`snapshot`), copies of resident shards
    and SnapRefs to the store's snapshot ([Note: background save] in background.py)."""
    store = eng.store
    optim = eng.step_driver.state_dict()["state"]  # the moments as StoreTensors: no copies
    tensors: list[tuple[str, torch.Tensor | ShardRef | SnapRef]] = []
    scalars: dict[str, Any] = {}
    for lay in layouts:
        for kind in lay.kinds:
            dtype = eng.dtype if kind == "param" else torch.float32
            ref = ShardRef(lay.key, kind, dtype, lay.shard_numel)
            if lay.moments is not None and kind in MOMENT_CLASSES:
                ref = ShardRef(lay.key, kind, lay.moments.dtype, lay.moments.stored_numel,
                               stored=True)
            parts = (store.snapshot_parts(lay.key, kind)  # type: ignore[arg-type]
                     if snapshot else None)
            if parts is not None:  # kept by the store's snapshot, read out later
                tensors.append((shard_name(lay.key, kind),
                                SnapRef(ref.dtype, ref.numel, tuple(parts))))
            elif snapshot:  # a consistent copy the next step cannot change
                with ref.use(store) as t:
                    tensors.append((shard_name(lay.key, kind), t.detach().to("cpu", copy=True)))
            else:
                tensors.append((shard_name(lay.key, kind), ref))
        if lay.trainable:
            split = optim[lay.key]
            tensors += [(shard_name(lay.key, OPTIM_PREFIX + n), t)
                        for n, t in split.tensors.items()]
            scalars[lay.key] = split.scalars
    rng_js, rng_t = rng_state(eng.device)
    tensors += list(rng_t.items())
    buffers = persistent_buffers(eng.module) if eng.comm.rank == 0 else {}
    tensors += [(BUFFER_PREFIX + n, b) for n, b in buffers.items()]
    if snapshot:
        tensors = [(n, t.detach().to("cpu", copy=True)) if isinstance(t, torch.Tensor) else
                   (n, t) for n, t in tensors]
    meta = {"tierzero": json.dumps({"rank": eng.comm.rank, "optimizer": scalars,
                                    "rng": rng_js})}
    manifest: dict[str, Any] = {}
    if eng.comm.rank == 0:
        manifest = {
            "format": FORMAT, "version": VERSION,
            "world_size": eng.comm.world_size, "compute_dtype": str(eng.dtype),
            # how the run kept its Adam moments ([Note: compressed moments in checkpoints])
            "state_precision": eng.config.offload.optimizer.state_precision,
            "groups": [lay.as_json() for lay in layouts],
            # model order (named_parameters, then persistent buffers) for consolidated output
            "order": [n for n, _ in eng.module.named_parameters()] + list(buffers),
            "engine": engine_state(eng),
            "config": as_dict(eng.config),
            "hf_config": hf_config_json(eng.module),
        }
    # a background save draws no progress bar: the training's own is on screen
    return RankPayload(tensors, meta, None if snapshot else store, manifest, client_bytes,
                       progress_enabled(eng.config.logging.progress, eng.comm.rank)
                       and not snapshot, share=eng.config.outputs.background_save_share)


def _write_rank_file(path: Path, payload: RankPayload, desc: str,
                     pacer: Pacer | None = None) -> dict[str, int]:
    """`pacer`: a background save's ([Note: background save] in background.py)."""
    entries = [TensorEntry(n, t.dtype, tuple(t.shape) if isinstance(t, torch.Tensor)
                           else (t.numel,)) for n, t in payload.tensors]
    bar = progress_bar(payload.progress, total=sum(e.nbytes for e in entries), unit="B",
                       unit_scale=True, desc=desc)
    sync_every = SYNC_EVERY if pacer is not None else 0
    with bar, SafetensorsWriter(path, entries, payload.metadata, sync_every=sync_every) as w:
        for (n, t), e in zip(payload.tensors, entries, strict=True):
            if isinstance(t, torch.Tensor):
                w.write(n, t)
            elif isinstance(t, SnapRef):
                if payload.snapshot is None or pacer is None:
                    raise CheckpointError(f"internal: {n!r} is in a snapshot, but the save "
                                          "holds none")
                write_snapshot_entry(w, n, t, payload.snapshot, pacer)
            else:  # streamed from the store, one shard at a time
                with t.use(payload.store) as shard:
                    w.write(n, shard)
            bar.update(e.nbytes)
    digest = w.close()
    return {"bytes": digest.nbytes, "crc32": digest.crc32}


def _client_state_bytes(client_state: Any) -> bytes:
    """client_state pickled, refused now (not at resume time) unless it loads back with
    torch.load(weights_only=True): dicts, lists, tensors and scalars."""
    try:
        buf = io.BytesIO()
        torch.save(client_state, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # pickling and the weights_only unpickler raise many types
        raise CheckpointError(f"client_state cannot be saved and restored with torch.load("
                              f"weights_only=True) ({exc}); keep it to dicts, lists, tensors "
                              "and scalars") from exc
    return data


def save_checkpoint(eng: ZeroEngine, directory: str | Path, tag: str | None = None,
                    client_state: Any = None, *,
                    background: BackgroundSaver | None = None) -> Path | PendingSave:
    """Write a complete checkpoint to `directory/tag` (default tag `global_step<N>`) and point
    `directory/latest` at it. A collective: every rank calls it. Returns the checkpoint path;
    with `background`, a PendingSave whose wait() returns it, while training goes on."""
    tag = f"global_step{eng.global_steps}" if tag is None else str(tag)
    check_tag(tag)
    root = Path(directory)
    final = root / tag
    # Checks every rank makes alike, before the first collective (a lone error would hang).
    if final.exists():
        raise CheckpointError(f"{final} already exists; pick another tag or remove it first "
                              "(a checkpoint is never overwritten in place)")
    client_bytes = _client_state_bytes(client_state) if client_state is not None else None
    tags = gather_objects(eng, tag)
    if any(t != tag for t in tags):
        raise CheckpointError(f"ranks passed different tags {tags}; every rank must save the "
                              "same tag")
    temp = root / temp_dir_name(tag)
    modes = output_modes(eng.config.outputs.permissions)
    error: str | None = None
    if eng.comm.rank == 0:
        try:
            make_output_dir(root, modes)
            if temp.exists():  # left by a killed save of this tag: ours to remove
                shutil.rmtree(temp)
            temp.mkdir(mode=modes.dir)
            os.chmod(temp, modes.dir)  # exactly, whatever the umask
        except OSError as exc:
            error = f"cannot create {temp} ({exc})"
    raise_if_any_failed(eng, error, f"save_checkpoint({str(root)!r}, tag={tag!r})")
    with_grad = eng.micro_steps % eng.grad_accum != 0  # mid-accumulation: keep partial grads
    # (a gradient zero_grad() marked is read as zeros: [Note: gradients zeroed on first use])
    layouts = group_layouts(eng, with_grad)
    if background is None:
        payload = _collect(eng, layouts, client_bytes, snapshot=False)
        return _SaveJob(eng.comm.rank, eng.comm.world_size, root, tag, payload, modes).run(
            eng.comm.group)
    # a deferred optimizer update is read as it lands ([Note: saving a deferred step] in
    # engine/checkpoint/deferred.py)
    capture = capture_deferred(eng, layouts)
    payload = _collect(eng, layouts, client_bytes, snapshot=True)
    why = _open_snapshot(eng, payload, capture.awaiting)
    if why is not None:  # every rank writes now, streaming from the store
        capture.settle(eng)
        payload = _collect(eng, layouts, client_bytes, snapshot=False)
    job = _SaveJob(eng.comm.rank, eng.comm.world_size, root, tag, payload, modes)
    job.stats.settle_s = capture.settle_s
    if why is not None:
        return background.completed(job, job.run(eng.comm.group), why)
    try:
        capture.attach(payload.snapshot)
        return background.submit(job)
    except BaseException:  # no writer will release the snapshot: its kept regions and copies
        if payload.snapshot is not None:
            payload.snapshot.close()
        raise


def _open_snapshot(eng: ZeroEngine, payload: RankPayload, awaiting: list[str]) -> str | None:
    """Open the store's snapshot of the payload's SnapRefs on every rank (`awaiting`: parts
    read once a deferred update has ended); when a rank cannot (no swap space for the kept
    regions), every rank releases its own and the reason is returned (a collective: the
    ranks agree, then all save synchronously)."""
    error: str | None = None
    try:
        payload.snapshot = eng.store.open_snapshot(
            payload.snapshot_keys(), eng.config.outputs.background_save_copy_bytes, awaiting)
    except SnapshotSpaceError as exc:
        error = str(exc)
    errors = [(r, e) for r, e in enumerate(gather_objects(eng, error)) if e is not None]
    if not errors:
        return None
    if payload.snapshot is not None:
        payload.snapshot.close()
        payload.snapshot = None
    why = "; ".join(f"rank {r}: {e}" for r, e in errors)
    log.warning("save_checkpoint(background=True): written synchronously instead, because %s",
                why)
    return why


@dataclass
class _SaveJob:
    """Writing and publishing one checkpoint from a captured payload (no engine access)."""

    rank: int
    world: int
    root: Path
    tag: str
    payload: RankPayload
    modes: OutputModes  # permission bits of the files and the directory (outputs.permissions)
    stats: SaveStats = field(default_factory=SaveStats)
    cancel: threading.Event = field(default_factory=threading.Event)  # BackgroundSaver.abandon

    def run(self, group: dist.ProcessGroup | None) -> Path:
        temp = self.root / temp_dir_name(self.tag)
        try:
            return self._write_and_publish(group, temp)
        except BaseException:
            if self.rank == 0:  # a failed save leaves nothing behind (the tag can be saved again)
                shutil.rmtree(temp, ignore_errors=True)
            raise
        finally:
            snap = self.payload.snapshot
            if snap is not None:  # kept regions and copies are released, taken or not
                self.stats.snapshot = snap.stats()
                snap.close()
                self.payload.snapshot = None
            self.stats.finished = time.perf_counter()

    def _write_and_publish(self, group: dist.ProcessGroup | None, temp: Path) -> Path:
        final = self.root / self.tag
        what = f"save_checkpoint({str(self.root)!r}, tag={self.tag!r})"
        digest: dict[str, int] | None = None
        error: str | None = None
        try:
            pacer = (Pacer(self.payload.share, self.cancel, self.stats)
                     if self.payload.snapshot is not None else None)
            digest = _write_rank_file(temp / rank_file(self.rank), self.payload,
                                      desc=f"save {self.tag}", pacer=pacer)
            self.stats.written_bytes = digest["bytes"]
            os.chmod(temp / rank_file(self.rank), self.modes.file)  # created 0600
        except (OSError, CheckpointError, ValueError, OffloadError) as exc:
            error = f"writing {temp / rank_file(self.rank)}: {exc}"
        _raise_if_failed(group, self.world, error, what)
        digests = _gather(group, self.world, digest)
        if self.rank == 0:
            try:
                _publish(self.root, temp, self.tag, self.payload, digests,
                         mode=self.modes.file)
            except (OSError, CheckpointError, ValueError) as exc:
                error = f"publishing {final}: {exc}"
        _raise_if_failed(group, self.world, error, what)
        log.info("checkpoint %s saved (%d ranks)", final, self.world)
        return final


def _publish(root: Path, temp: Path, tag: str, payload: RankPayload,
             digests: list[dict[str, int]], *, mode: int) -> None:
    files = {rank_file(r): d for r, d in enumerate(digests)}
    manifest = dict(payload.manifest)
    hf = manifest.pop("hf_config", None)
    if payload.client_bytes is not None:
        d = write_bytes_durable(temp / CLIENT_STATE, payload.client_bytes, mode)
        files[CLIENT_STATE] = {"bytes": d.nbytes, "crc32": d.crc32}
    if hf is not None:
        d = write_bytes_durable(temp / HF_CONFIG, hf.encode(), mode)
        files[HF_CONFIG] = {"bytes": d.nbytes, "crc32": d.crc32}
    manifest["tag"] = tag
    manifest["files"] = files
    manifest[MANIFEST_CRC] = manifest_checksum(manifest)  # covers every value above
    write_bytes_durable(temp / MANIFEST, json.dumps(manifest, indent=1).encode(), mode)
    fsync_dir(temp)
    final = root / tag
    temp.rename(final)
    fsync_dir(root)
    latest_tmp = root / f".{LATEST}.partial"
    write_bytes_durable(latest_tmp, tag.encode(), mode)
    replace_durable(latest_tmp, root / LATEST)
