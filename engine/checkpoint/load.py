"""`ZeroEngine.load_checkpoint`: check, then restore shards and state from a checkpoint.

Layout: [Note: checkpoint layout] in engine/checkpoint/save.py. Every file a rank
reads is checked (size, then CRC-32, against the manifest) before any of its
bytes are used; the model layout is compared with the saved one first, so a
mismatch changes nothing. At the saved world size each rank reads only its
own file; at another world size each rank reads its new slice of every
group's full buffer from the saved ranks that hold it (resharding is exact:
every saved kind is element-wise, except int8 moments, decoded and re-encoded at the new
block boundaries: [Note: compressed moments in checkpoints] in save.py).
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tierzero.engine.checkpoint.layout import (
    BUFFER_PREFIX,
    CLIENT_STATE,
    RNG_PREFIX,
    CheckpointError,
    GroupLayout,
    RankFiles,
    load_manifest,
    rank_file,
    resolve,
    saved_layouts,
    shard_name,
    verify_files,
)
from tierzero.engine.checkpoint.save import (
    gather_objects,
    group_layouts,
    raise_if_any_failed,
    shard_use,
)
from tierzero.engine.checkpoint.state import (
    OPTIM_PREFIX,
    persistent_buffers,
    restore_engine_state,
    restore_rng,
)
from tierzero.engine.progress import progress_bar
from tierzero.offload.settings import MOMENT_CLASSES
from tierzero.offload.state_codec import StoredLayout
from tierzero.offload.step_seam import GroupState

if TYPE_CHECKING:
    from tierzero.engine.engine import ZeroEngine
    from tierzero.engine.shards.store import ShardStore

log = logging.getLogger(__name__)


def _check_layout(eng: ZeroEngine, path: Path, manifest: dict[str, Any]) -> list[GroupLayout]:
    saved = saved_layouts(path, manifest)
    mine = group_layouts(eng, with_grad=False)
    if manifest["compute_dtype"] != str(eng.dtype):
        raise CheckpointError(f"{path} was saved with compute dtype {manifest['compute_dtype']}"
                              f", the engine computes in {eng.dtype}; load with the same "
                              "precision.dtype")
    partial = [g.key for g in saved if "grad" in g.kinds]
    if partial and eng.store.grad_dtype != torch.float32:
        # [Note: gradient precision]: a partial sum is fp32; the shards here hold the
        # compute dtype, which would round it
        raise CheckpointError(
            f"{path} was saved mid-accumulation and holds partial fp32 gradients (groups "
            f"{partial[:3]}); this engine keeps gradients in {eng.store.grad_dtype} (world "
            "size 1, no accumulation); load it with the saved "
            "batch.gradient_accumulation_steps, or set precision.grad_dtype: fp32")
    want = [(g.key, g.trainable, g.params) for g in mine]
    got = [(g.key, g.trainable, g.params) for g in saved]
    if want != got:
        diffs = [f"engine {w[0]!r} vs saved {g[0]!r}" if w[0] != g[0] else
                 f"group {w[0]!r} differs in parameters or trainable flag"
                 for w, g in zip(want, got, strict=False) if w != g]
        if len(want) != len(got):
            diffs.insert(0, f"engine has {len(want)} flat groups, checkpoint {len(got)}")
        raise CheckpointError(f"{path} holds a different model layout: {'; '.join(diffs[:5])}. "
                              "Build the same model with the same zero.units and frozen "
                              "parameters as when saving")
    return saved


def load_checkpoint(eng: ZeroEngine, directory: str | Path, tag: str | None = None,
                    *, verify: bool = True) -> tuple[Path, Any]:
    """Restore shards, optimizer, schedule, loss scaler, counters, RNG and module buffers.

    A collective: every rank calls it. Returns (checkpoint path, client_state or None).
    `verify=False` skips the CRC-32 pass (sizes are always checked).
    """
    error: str | None = None
    path: Path | None = None
    plan: tuple[dict[str, Any], list[GroupLayout]] | None = None
    try:
        path = resolve(directory, tag)
        manifest = load_manifest(path)
        plan = (manifest, _check_layout(eng, path, manifest))
    except (CheckpointError, ValueError) as exc:
        error = str(exc)
    raise_if_any_failed(eng, error, f"load_checkpoint({str(directory)!r}, tag={tag!r})")
    if path is None or plan is None:  # unreachable: a failure raised above
        raise CheckpointError("load_checkpoint: no checkpoint resolved")
    manifest, saved = plan
    paths = gather_objects(eng, str(path))
    if any(p != str(path) for p in paths):
        raise CheckpointError(f"ranks resolved different checkpoints {paths}; `latest` changed "
                              "while loading, or the ranks see different file systems")
    saved_world, world, rank = int(manifest["world_size"]), eng.comm.world_size, eng.comm.rank
    same_world = saved_world == world
    if same_world:
        names = [rank_file(rank)] + ([rank_file(0)] if rank != 0 else [])
    else:
        names = [rank_file(r) for r in range(saved_world)]
        log.warning("%s was saved by %d ranks, loading into %d: shards are resliced (exact); "
                    "RNG streams of ranks >= %d restart from rank 0's", path, saved_world,
                    world, saved_world)
    if CLIENT_STATE in manifest["files"]:
        names.append(CLIENT_STATE)
    if rank == 0:
        mine = group_layouts(eng, with_grad=False)
        _log_moment_conversion(path, manifest, saved, mine, same_world)
        _log_master_conversion(path, saved, mine)
    error = None
    try:  # every rank's files are checked before any rank changes anything
        _check_files(path, manifest, names, verify)
    except (CheckpointError, OSError) as exc:
        error = str(exc)
    raise_if_any_failed(eng, error, f"load_checkpoint({str(path)!r})")
    error = None
    try:
        _restore(eng, path, manifest, saved, same_world)
    except (CheckpointError, ValueError, RuntimeError) as exc:
        error = str(exc)
    # Shards changed: gathered copies are gathered again once every rank has restored, or
    # dropped (locally) when any rank failed ([Note: persistent units after the step]).
    eng.scheduler.mark_stale()
    try:
        raise_if_any_failed(eng, error, f"load_checkpoint({str(path)!r})")
    except CheckpointError:
        eng.scheduler.drop_stale()
        raise
    eng.scheduler.refresh()
    client = None
    if CLIENT_STATE in manifest["files"]:
        client = torch.load(io.BytesIO((path / CLIENT_STATE).read_bytes()), weights_only=True)
    log.info("checkpoint %s loaded (saved by %d ranks, step %d)", path, saved_world,
             eng.global_steps)
    return path, client


def _log_moment_conversion(path: Path, manifest: dict[str, Any], saved: list[GroupLayout],
                            mine: list[GroupLayout], same_world: bool) -> None:
    """One warning when the moments are not copied as they are: what they were saved as,
    what this run keeps, and whether the conversion is exact ([Note: compressed moments in
    checkpoints] in save.py)."""
    pairs = [(s.saved_moments(), m.moments) for s, m in zip(saved, mine, strict=True)
             if s.trainable and m.moments is not None]
    changed = [(a, b) for a, b in pairs if not same_world or a != b]
    if not changed:
        return
    a, b = changed[0]
    if a.precision == b.precision != "int8":
        return  # fp32 / bf16 resliced: element-wise, exact (the reshard warning says so)
    kept = manifest.get("state_precision", "fp32")
    old = kept != "fp32" and all(s.moments is None for s in saved if s.trainable)
    if b.precision == "fp32":
        how = "decoded, exact"
    elif old and kept == b.precision:
        how = ("the files hold them decoded to fp32 (written before compressed moments were "
               f"saved as kept): encoded to {b.precision} again, exact where this run's "
               "blocks start where the saving run's did")
    elif a.precision == b.precision:
        where = (f"saved by {manifest['world_size']} ranks" if not same_world else
                 f"saved as {a.describe()}, kept as {b.describe()}")
        how = (f"decoded and encoded again at this run's block boundaries ({where}): "
               f"rounded once to {b.precision}")
    else:
        how = (f"{'decoded from ' + a.precision + ', ' if a.precision != 'fp32' else ''}"
               f"rounded once to {b.precision}")
    log.warning("%s kept its Adam moments as %s, this run keeps them as %s: they are "
                "converted on load in %d of %d groups (%s; [Note: compressed moments in "
                "checkpoints])", path, kept if old else a.precision, b.precision,
                len(changed), len(pairs), how)


# [Note: master precision in checkpoints]
# A trainable group's weights are saved as its master: "master" (fp32) by default, "param"
# (the compute dtype) with offload.optimizer.master_precision bf16, where the compute copy
# is the master ([Note: bf16 master weights] in offload/bf16_master.py). Either loads into
# a run of the other precision, logged once: an fp32 master rounded to nearest bf16 (what
# the saving run's compute copy held, bit for bit: param was the master rounded to
# nearest), a bf16 master upcast to fp32 exactly. The moments and the step count load as
# they do within one precision, so the next step continues from the same state.
def _log_master_conversion(path: Path, saved: list[GroupLayout],
                           mine: list[GroupLayout]) -> None:
    pairs = [(s, m) for s, m in zip(saved, mine, strict=True) if s.trainable]
    changed = [(s, m) for s, m in pairs if ("master" in s.kinds) != ("master" in m.kinds)]
    if not changed:
        return
    fp32_saved = "master" in changed[0][0].kinds
    log.warning("%s was saved with %s master weights, this run keeps %s (offload.optimizer."
                "master_precision): %s in %d of %d groups ([Note: master precision in "
                "checkpoints])", path, *(("fp32", "bf16", "rounded to nearest bf16 once")
                                         if fp32_saved else
                                         ("bf16", "fp32", "upcast to fp32, exact")),
                len(changed), len(pairs))


def _restore_weights(store: ShardStore, lay: GroupLayout, kind: str, source: _Saved,
                     compute: torch.dtype) -> None:
    """A saved master or param into this run's shard, converted where the saving run kept
    the other master precision ([Note: master precision in checkpoints]). Every element is
    replaced: an NVMe shard's old bytes are not read."""
    want = kind
    if lay.trainable and kind in ("master", "param"):
        want = "master" if store.has(lay.key, "master") else "param"
    if want == kind:
        with shard_use(store, lay.key, kind, overwrite=True) as dest:
            source.read_into(dest)
        return
    values = torch.empty(source.numel, dtype=torch.float32 if kind == "master" else compute)
    source.read_into(values)
    with shard_use(store, lay.key, want, overwrite=True) as dest:
        dest.copy_(values)  # fp32 -> bf16 to nearest even; bf16 -> fp32 exact


def _check_files(path: Path, manifest: dict[str, Any], names: list[str], verify: bool) -> None:
    if verify:
        verify_files(path, manifest, names)
        return
    for name in names:  # sizes only: catches truncation without reading the data
        want = manifest["files"][name]["bytes"]
        got = (path / name).stat().st_size if (path / name).is_file() else -1
        if got != want:
            raise CheckpointError(f"{path / name} is {got} bytes, the manifest says {want}: "
                                  "the file is truncated, missing or was changed")


def _restore(eng: ZeroEngine, path: Path, manifest: dict[str, Any], saved: list[GroupLayout],
             same_world: bool) -> None:
    rank = eng.comm.rank
    files = RankFiles(path, int(manifest["world_size"]))
    src_rank = rank if same_world or rank < files.world_size else 0
    try:
        meta = files.handle(src_rank).metadata() or {}
        rank_meta = json.loads(meta["tierzero"])
        store = eng.store
        shard_numel = {g.key: g.shard_numel for u in eng.units for g in u.groups}
        bar = progress_bar(eng.config.logging.progress, rank, total=len(saved), unit="group",
                           desc=f"load {path.name}")
        # the optimizer's part of each group, for the step driver to read into its place
        optim: dict[str, GroupState] = {}
        for lay in saved:
            n = shard_numel[lay.key]
            group = GroupState(scalars=dict(rank_meta["optimizer"][lay.key])
                               if lay.trainable else {})
            for kind in (*lay.kinds, *_optim_names(files, src_rank, lay.key)):
                source = _Saved(files, lay, kind, rank, same_world, n)
                if kind.startswith(OPTIM_PREFIX):
                    group.tensors[kind.removeprefix(OPTIM_PREFIX)] = source
                elif kind in MOMENT_CLASSES:
                    group.shards[kind] = source
                else:
                    _restore_weights(store, lay, kind, source, eng.dtype)
            bar.update(1)
            if lay.trainable:
                optim[lay.key] = group
                if "grad" not in lay.kinds:
                    with shard_use(store, lay.key, "grad", overwrite=True) as grad:
                        grad.zero_()
                store.write_param_from_master(lay.key)  # (the grad writes took its mark)
        eng.step_driver.load_state_dict({"param_groups": manifest["engine"]["param_groups"],
                                         "state": optim})
        restore_engine_state(eng, manifest["engine"])
        rng = {n: files.tensor(src_rank, n) for n in _names(files, src_rank, RNG_PREFIX)}
        restore_rng(rank_meta["rng"], rng, eng.device)
        _restore_buffers(eng, files)
        bar.close()
    finally:
        files.close()


def _names(files: RankFiles, rank: int, prefix: str) -> list[str]:
    return [n for n in files.names(rank) if n.startswith(prefix)]


def _optim_names(files: RankFiles, rank: int, key: str) -> list[str]:
    head = shard_name(key, OPTIM_PREFIX)
    return [n.removeprefix(shard_name(key, "")) for n in _names(files, rank, head)]


@dataclass(frozen=True)
class _Saved:
    """One saved shard of this rank's group, read on demand (offload.step_seam.TensorSource,
    its stored form for the moments): from this rank's file at the saved world size, else
    its new slice of the saved ranks'."""

    files: RankFiles
    lay: GroupLayout
    kind: str
    rank: int
    same_world: bool
    numel: int  # this rank's shard

    def read_into(self, out: torch.Tensor) -> None:
        """The values (a moment decoded to fp32)."""
        moment = self.kind in MOMENT_CLASSES
        if self.same_world and (not moment or self.lay.saved_moments().precision == "fp32"):
            self.files.read_into(self.rank, self.lay.tensor_name(self.kind), out)
        elif moment:
            lo = self.rank * self.numel
            out.copy_(self.files.read_moment_range(self.lay, self.kind, lo, lo + self.numel))
        else:
            lo = self.rank * self.numel
            out.copy_(self.files.read_range(self.lay, self.kind, lo, lo + self.numel))

    def stored_as(self) -> StoredLayout | None:
        """A moment's saved layout when this rank's saved tensor is its whole shard."""
        return self.lay.saved_moments() if self.same_world else None

    def read_stored_into(self, out: torch.Tensor) -> None:
        self.files.read_into(self.rank, self.lay.tensor_name(self.kind), out)


def _restore_buffers(eng: ZeroEngine, files: RankFiles) -> None:
    mine = persistent_buffers(eng.module)
    saved = {n.removeprefix(BUFFER_PREFIX) for n in _names(files, 0, BUFFER_PREFIX)}
    if saved != set(mine):
        raise CheckpointError(f"{files.path / rank_file(0)}: module buffers differ; missing "
                              f"{sorted(set(mine) - saved)[:5]}, unexpected "
                              f"{sorted(saved - set(mine))[:5]}")
    with torch.no_grad():
        for n, b in mine.items():
            b.copy_(files.tensor(0, BUFFER_PREFIX + n))
