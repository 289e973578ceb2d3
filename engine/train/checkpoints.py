"""Checkpoints of `tierzero train`: where they go, what a resume continues from.

The engine's checkpoint holds the model, optimizer, schedule, loss scaler and
RNG states; the job adds its own position as `client_state`:

    {"train": {"step": <steps done>, "batches_drawn": <Batches.drawn>}}

so a resumed run continues the step count, the lr schedule and the data
stream exactly where the saved one stopped (every rank draws its own batches
from a seeded generator; they all drew the same number). Checkpoints are
tagged `step<N>` by the job's step count (engine.global_steps lags it when
fp16 skips steps).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tierzero import engine
from tierzero.engine.checkpoint.io import replace_durable, write_bytes_durable
from tierzero.engine.checkpoint.layout import (
    CLIENT_STATE,
    HF_CONFIG,
    LATEST,
    MANIFEST,
    CheckpointError,
    load_manifest,
)
from tierzero.engine.config.train import TrainConfig
from tierzero.engine.train.data import Batches

log = logging.getLogger(__name__)


class TrainError(ValueError):
    """A train setting that cannot be honoured; the message names it and the way out."""


@dataclass(frozen=True)
class ResumeFrom:
    """A checkpoint to continue from: its directory and tag (None: the one `latest` names)."""

    directory: str
    tag: str | None


def resume_source(tc: TrainConfig) -> ResumeFrom | None:
    """Where train.resume points, checked to hold a complete checkpoint (before any work)."""
    if tc.resume is False:
        return None
    if tc.resume is True:
        if tc.checkpoint_dir is None:
            raise TrainError("train.resume: true needs train.checkpoint_dir (each run writes "
                             "into a new run directory, so there is no earlier one to find); "
                             "set checkpoint_dir to where the run saved, or give resume the "
                             "checkpoint path")
        where = Path(tc.checkpoint_dir)
        what = f"train.resume: true (train.checkpoint_dir '{where}')"
    else:
        where = Path(tc.resume)
        what = f"train.resume: '{where}'"
    if (where / MANIFEST).is_file():  # one checkpoint: <dir>/<tag>
        return ResumeFrom(str(where.parent), where.name)
    newest = newest_checkpoint(where)
    if newest is not None:
        return ResumeFrom(str(where), newest)
    if (where / LATEST).is_file():
        return ResumeFrom(str(where), None)
    raise TrainError(f"{what}: no checkpoint there (neither {where / LATEST} nor "
                     f"{where / MANIFEST} exists); point it at a checkpoint directory or one "
                     "checkpoint, or set train.resume: false to start fresh")


_STEP_TAG = re.compile(r"step(\d+)")


def newest_checkpoint(directory: str | Path) -> str | None:
    """The tag of the newest complete `step<N>` checkpoint in `directory` (largest N whose
    manifest passes its own checksum), or None when it holds none.

    Not simply what `latest` names: a run killed after a checkpoint was published but
    before `latest` moved leaves `latest` one checkpoint behind ([Note: checkpoint layout]
    in engine/checkpoint/save.py), and resuming from there would lose that step and then refuse
    to save it again. A damaged newest checkpoint is skipped with a warning."""
    root = Path(directory)
    if not root.is_dir():
        return None
    steps = sorted(((int(m.group(1)), p.name) for p in root.iterdir()
                    if (m := _STEP_TAG.fullmatch(p.name)) and (p / MANIFEST).is_file()),
                   reverse=True)
    for _, tag in steps:
        try:
            load_manifest(root / tag)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", root / tag, exc)
            continue
        return tag
    return None


def repair_latest(directory: str | Path, tag: str) -> None:
    """Point `directory/latest` at `tag` when it names an older (or no) checkpoint; only the
    run holding the directory's lock calls this ([Note: run locks] in run_lock.py)."""
    root = Path(directory)
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    if named == tag:
        return
    log.warning("%s names %s, but %s is complete and newer (the run that saved it was "
                "stopped before moving latest): resuming from %s and pointing latest at it",
                latest, named, tag, tag)
    tmp = root / f".{LATEST}.partial"
    write_bytes_durable(tmp, tag.encode())
    replace_durable(tmp, latest)


_PARTIAL = re.compile(r"\.(.+)\.partial")
_PARTIAL_FILES = re.compile(r"rank\d{5}\.safetensors(\.tmp)?|" + re.escape(MANIFEST) + "|"
                            + re.escape(CLIENT_STATE) + "|" + re.escape(HF_CONFIG))


def remove_partial_saves(directory: str | Path) -> list[str]:
    """Remove what killed or failed saves left in `directory` (`.<tag>.partial/`, the
    `.latest.partial` file); only the run holding the directory's lock calls this, so no
    save is in progress. A `.partial` directory holding anything a save does not write is
    left alone (not ours to delete). Returns the names removed."""
    root = Path(directory)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if not _PARTIAL.fullmatch(p.name) or p.is_symlink():
            continue
        if p.name == f".{LATEST}.partial" and p.is_file():
            p.unlink()
        elif p.is_dir() and all(_PARTIAL_FILES.fullmatch(f.name) and f.is_file()
                                and not f.is_symlink() for f in p.iterdir()):
            shutil.rmtree(p)
        else:
            continue
        removed.append(p.name)
    if removed:
        log.info("removed what interrupted saves left in %s: %s", root, ", ".join(removed))
    return removed


def check_checkpoint_settings(tc: TrainConfig) -> None:
    """Refuse, before any work, a run that would resume from nothing or save over old runs."""
    source = resume_source(tc)
    saves = tc.checkpoint_interval or tc.save_on_interrupt
    if source is None and saves and tc.checkpoint_dir is not None:
        latest = Path(tc.checkpoint_dir) / LATEST
        newest = newest_checkpoint(tc.checkpoint_dir)
        if latest.is_file() or newest is not None:
            named = (f"latest: {latest.read_text().strip()}" if latest.is_file()
                     else f"newest: {newest}")
            raise TrainError(f"train.checkpoint_dir '{tc.checkpoint_dir}' already holds "
                             f"checkpoints ({named}); set "
                             "train.resume: true to continue that run, or pick another "
                             "directory")


def check_no_overwrite(tc: TrainConfig, directory: str, start: int) -> None:
    """A run resumed from an earlier checkpoint than the directory's newest would save a tag
    that exists (checkpoints are never overwritten): refuse before the first step."""
    if not tc.checkpoint_interval:
        return
    first = (start // tc.checkpoint_interval + 1) * tc.checkpoint_interval
    taken = [f"step{s}" for s in range(first, tc.steps + 1, tc.checkpoint_interval)
             if (Path(directory) / f"step{s}").exists()]
    if taken:
        raise TrainError(f"resuming at step {start} would save {taken[0]} into {directory}, "
                         f"which already holds it (and {len(taken) - 1} more later ones); "
                         "checkpoints are never overwritten: set train.checkpoint_dir to "
                         "another directory, or remove those checkpoints")


def checkpoint_dir(tc: TrainConfig, run_dir: str) -> str:
    return tc.checkpoint_dir or os.path.join(run_dir, "checkpoints")


def resume(eng: engine.ZeroEngine, batches: Batches, source: ResumeFrom) -> int:
    """Load the checkpoint into `eng`, move `batches` to its data position; the step
    count reached."""
    path, client = eng.load_checkpoint(source.directory, source.tag)
    position = client.get("train") if isinstance(client, dict) else None
    if not isinstance(position, dict) or not {"step", "batches_drawn"} <= set(position):
        raise TrainError(f"{path} was not written by tierzero train (its client_state has no "
                         "train position); resume from a checkpoint the job saved, or load it "
                         "with eng.load_checkpoint in your own loop")
    batches.skip(int(position["batches_drawn"]))
    step = int(position["step"])
    log.info("resumed from %s at step %d (%d batches drawn per rank)", path, step,
             batches.drawn)
    return step


def save(eng: engine.ZeroEngine, directory: str, step: int, batches: Batches, *,
         background: bool) -> tuple[str, Path | engine.PendingSave]:
    """Save `step<step>`, in the background when `background` (train.checkpoint_background:
    [Note: background save] in engine/checkpoint/background.py); every later save and
    eng.close() waits for it. Returns the checkpoint's path and save_checkpoint's result."""
    result = eng.save_checkpoint(directory, tag=f"step{step}", background=background,
                                 client_state={"train": {"step": step,
                                                         "batches_drawn": batches.drawn}})
    log.info("checkpoint step%d -> %s", step, directory)
    return str(Path(directory) / f"step{step}"), result


def resolved_path(source: ResumeFrom) -> str:
    """The checkpoint directory `source` names (its `latest` read when no tag is given)."""
    if source.tag is not None:
        return str(Path(source.directory) / source.tag)
    latest = Path(source.directory) / LATEST
    return str(Path(source.directory) / latest.read_text().strip())
