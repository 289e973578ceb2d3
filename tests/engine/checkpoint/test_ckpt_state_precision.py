"""Checkpoints of compressed moments (offload.optimizer.state_precision bf16 / int8): the files
hold the moments as the store keeps them ([Note: compressed moments in checkpoints] in
engine/checkpoint/save.py), a resume within a precision is bit-exact, loads into another
precision or world size convert through the codec (compared with state_codec exactly),
checkpoints from before the format still load, CRC catches damage, consolidate works.

NVMe runs use pieces of CHUNK elements (offload.optimizer.chunk_numel), so the larger
shards are stored in several pieces and the int8 blocks restart at each piece.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import resume_config
from engine_dist import run_two_ranks
from engine_helpers import full_params, make_batches, make_model

from tierzero import engine
from tierzero.engine.checkpoint.layout import (
    MANIFEST,
    MANIFEST_CRC,
    GroupLayout,
    RankFiles,
    load_manifest,
    manifest_checksum,
    rank_file,
    shard_name,
)
from tierzero.engine.config import Config
from tierzero.offload import state_codec as sc

CHUNK = 1000  # not a multiple of the block: the last block of each piece is short
KINDS = ("exp_avg", "exp_avg_sq")


def _config(prec: str, offload: str, swap: Path) -> Config:
    cfg = resume_config("bf16", 1, offload, str(swap))
    opt = replace(cfg.offload.optimizer, state_precision=prec,  # type: ignore[arg-type]
                  chunk_numel=CHUNK)
    return replace(cfg, offload=replace(cfg.offload, optimizer=opt))


def _engine(prec: str, offload: str, swap: Path) -> tuple[Any, torch.nn.Module]:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=_config(prec, offload, swap),
                                     device="cpu")
    return eng, model


def _train(eng: Any, start: int, stop: int, seed: int = 1) -> list[float]:
    losses = []
    for ids, tg in make_batches(stop, seed=seed)[start:stop]:
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
    return losses


def _stored(eng: Any) -> dict[str, torch.Tensor]:
    """Every moment's stored form (copies), by "<key>::<kind>", once a deferred update
    (offload cpu: the in-place step runs into the next forward) has landed."""
    eng.step_driver.settle()  # deferred=True: drains the deferred update too
    out = {}
    for key in eng.store.group_keys():
        for kind in KINDS:
            if eng.store.has(key, kind):
                with eng.store.use_stored(key, kind) as t:
                    out[shard_name(key, kind)] = t.clone()
    return out


def _saved(path: Path, world: int = 1) -> dict[str, torch.Tensor]:
    files = RankFiles(path, world)
    try:
        return {n: files.tensor(0, n) for n in files.names(0)
                if n.endswith(("::exp_avg", "::exp_avg_sq"))}
    finally:
        files.close()


def _layouts(path: Path) -> dict[str, GroupLayout]:
    return {g["key"]: GroupLayout.from_json(g) for g in load_manifest(path)["groups"]}


def _save_trained(prec: str, offload: str, tmp: Path, n: int = 3, tag: str = "t") -> Path:
    eng, _ = _engine(prec, offload, tmp / f"swap_{tag}")
    try:
        _train(eng, 0, n)
        path = eng.save_checkpoint(tmp / "ck", tag=tag)
        assert isinstance(path, Path)
        return path
    finally:
        eng.close()


@pytest.mark.parametrize(("prec", "offload"), [("bf16", "nvme"), ("int8", "nvme"),
                                               ("int8", "cpu")])
def test_resume_is_bit_exact_and_files_hold_the_kept_bytes(prec: str, offload: str,
                                                           tmp_path: Path) -> None:
    """Losses, parameters and stored moments after save, load, M steps equal the
    uninterrupted run's; the files hold the store's bytes at the compressed size."""
    n, m = 3, 3
    a, model_a = _engine(prec, offload, tmp_path / "a")
    try:
        _train(a, 0, n)
        at_save = _stored(a)
        path = a.save_checkpoint(tmp_path / "ck", tag="t")
        full_losses = _train(a, n, n + m)
        full, full_moments = full_params(a, model_a), _stored(a)
    finally:
        a.close()
    assert isinstance(path, Path)
    saved, layouts = _saved(path), _layouts(path)
    assert saved.keys() == at_save.keys() and saved
    for name, raw in saved.items():
        key = name.rsplit("::", 1)[0]
        lay = layouts[key].moments
        assert lay is not None and lay.precision == prec
        n_el = layouts[key].shard_numel
        step = CHUNK if offload == "nvme" and prec == "int8" and n_el > CHUNK else n_el
        want = sum(sc.moment_nbytes(min(n_el, lo + step) - lo, prec)
                   for lo in range(0, n_el, step))
        assert raw.dtype == torch.uint8 and raw.numel() == want == lay.nbytes, name
        assert torch.equal(raw, at_save[name]), name  # the same bytes the store held
    assert any(g.moments is not None and g.moments.piece_numel == CHUNK
               for g in layouts.values()) == (offload == "nvme" and prec == "int8")
    manifest = load_manifest(path)
    assert manifest["state_precision"] == prec
    b, model_b = _engine(prec, offload, tmp_path / "b")
    try:
        b.load_checkpoint(tmp_path / "ck", tag="t")
        assert all(torch.equal(v, _stored(b)[k]) for k, v in at_save.items())
        assert _train(b, n, n + m) == full_losses
        resumed, moments = full_params(b, model_b), _stored(b)
    finally:
        b.close()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    assert all(torch.equal(full_moments[k], moments[k]) for k in full_moments)


def test_checkpoint_size_falls_with_the_precision(tmp_path: Path) -> None:
    """The moment tensors take 4, 2 and ~1.016 bytes per element (plus int8's padding)."""
    sizes = {}
    for prec in ("fp32", "bf16", "int8"):
        saved = _saved(_save_trained(prec, "cpu", tmp_path, n=1, tag=prec))
        sizes[prec] = sum(t.numel() * t.element_size() for t in saved.values())
    n_el = sizes["fp32"] // 4
    assert sizes["bf16"] == 2 * n_el
    assert n_el < sizes["int8"] < 1.1 * n_el


def _decoded(raw: torch.Tensor, lay: sc.StoredLayout, kind: str) -> torch.Tensor:
    out = torch.empty(lay.numel)
    lay.decode(kind, raw, out)
    return out


@pytest.mark.parametrize(("src", "dst"), [("int8", "fp32"), ("fp32", "int8"),
                                          ("int8", "bf16"), ("bf16", "int8")])
def test_load_into_another_precision_is_the_codecs_conversion(
        src: str, dst: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The loaded moments are exactly the saved ones decoded, then encoded in the run's
    layout (NVMe pieces of CHUNK); logged once, naming both precisions."""
    path = _save_trained(src, "nvme", tmp_path)
    saved, layouts = _saved(path), _layouts(path)
    eng, _ = _engine(dst, "nvme", tmp_path / "dst")
    try:
        with caplog.at_level(logging.WARNING):
            eng.load_checkpoint(tmp_path / "ck", tag="t")
        msgs = [r.getMessage() for r in caplog.records if "Adam moments" in r.getMessage()]
        assert len(msgs) == 1
        assert f"kept its Adam moments as {src}, this run keeps them as {dst}" in msgs[0]
        assert ("exact" if dst == "fp32" else f"rounded once to {dst}") in msgs[0]
        got = _stored(eng)
        for name, raw in saved.items():
            key, kind = name.rsplit("::", 1)
            saved_lay = layouts[key].moments
            assert saved_lay is not None and saved_lay.precision == src
            mine = eng.store.moment_layout(key, kind)
            want = torch.empty(mine.stored_numel, dtype=mine.dtype)
            mine.encode(kind, _decoded(raw, saved_lay, kind), want)
            assert torch.equal(got[name], want), name
        _train(eng, 3, 4)  # and it trains on
    finally:
        eng.close()


def _load_world2(rank: int, *, prec: str, ckpt: str, swap: str) -> dict[str, Any]:
    eng, model = _engine(prec, "nvme", Path(swap) / f"rank{rank}")
    try:
        eng.load_checkpoint(ckpt, tag="t")
        out = {"stored": _stored(eng), "numel": {k: eng.store.numel(k)
                                                 for k in eng.store.group_keys()},
               "layouts": {k: eng.store.moment_layout(k, "exp_avg")
                           for k in eng.store.group_keys() if eng.store.has(k, "exp_avg")},
               "steps": eng.global_steps}
        out["losses"] = _train(eng, 3, 5, seed=1 + rank)
        out["params"] = full_params(eng, model)
        return out
    finally:
        eng.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("prec", ["bf16", "int8"])
def test_compressed_checkpoint_loads_into_two_ranks(prec: str, tmp_path: Path) -> None:
    """Saved by one rank, loaded by two: each rank's moments are the saved full buffer
    decoded, resliced and encoded at its own block boundaries (bf16: element-wise, so the
    same bytes resliced)."""
    path = _save_trained(prec, "nvme", tmp_path)
    layouts = _layouts(path)
    files = RankFiles(path, 1)
    try:
        full = {shard_name(k, kind): files.read_moment_range(g, kind, 0, 2 * g.shard_numel)
                for k, g in layouts.items() if g.moments is not None for kind in KINDS}
    finally:
        files.close()
    (tmp_path / "w2").mkdir()
    res = run_two_ranks(tmp_path / "w2", {"run": partial(
        _load_world2, prec=prec, ckpt=str(tmp_path / "ck"), swap=str(tmp_path / "s2"))})
    for rank in range(2):
        r = res[rank]["run"]
        assert r["steps"] == 3
        for name, got in r["stored"].items():
            key, kind = name.rsplit("::", 1)
            n = r["numel"][key]
            lay = r["layouts"][key]
            want = torch.empty(lay.stored_numel, dtype=torch.uint8)
            lay.encode(kind, full[name][rank * n:(rank + 1) * n], want)
            assert torch.equal(got, want), (rank, name)
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert all(torch.equal(res[0]["run"]["params"][k], res[1]["run"]["params"][k])
               for k in res[0]["run"]["params"])


def test_checkpoint_with_decoded_moments_from_before_still_loads(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The format before this one: moments decoded to fp32 in the files, "state_precision"
    int8 in the manifest, no "moments" layout. Written here as that version wrote it (an
    fp32 save of the int8 run's decoded moments, its manifest edited back), it loads into
    an int8 run with the same pieces as the very bytes the int8 run kept."""
    n, m = 3, 2
    a, model_a = _engine("int8", "nvme", tmp_path / "a")
    b, _ = _engine("fp32", "nvme", tmp_path / "b")
    try:
        _train(a, 0, n)
        a.save_checkpoint(tmp_path / "ck", tag="q")
        kept = _stored(a)
        b.load_checkpoint(tmp_path / "ck", tag="q")  # decoded, exact
        old = b.save_checkpoint(tmp_path / "ck", tag="old")
        full_losses = _train(a, n, n + m)
        full = full_params(a, model_a)
    finally:
        a.close()
        b.close()
    assert isinstance(old, Path)
    manifest = json.loads((old / MANIFEST).read_text())
    manifest["state_precision"] = "int8"
    for g in manifest["groups"]:
        g.pop("moments", None)
    manifest[MANIFEST_CRC] = manifest_checksum(manifest)
    (old / MANIFEST).write_text(json.dumps(manifest, indent=1))
    c, model_c = _engine("int8", "nvme", tmp_path / "c")
    try:
        with caplog.at_level(logging.WARNING):
            c.load_checkpoint(tmp_path / "ck", tag="old")
        assert "decoded to fp32" in caplog.text
        got = _stored(c)
        assert all(torch.equal(kept[k], got[k]) for k in kept)
        assert _train(c, n, n + m) == full_losses
        resumed = full_params(c, model_c)
        assert all(torch.equal(full[k], resumed[k]) for k in full)
    finally:
        c.close()


def test_damaged_compressed_moment_is_caught_by_crc(tmp_path: Path) -> None:
    path = _save_trained("int8", "nvme", tmp_path)
    file = path / rank_file(0)
    data = bytearray(file.read_bytes())
    head = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + head])
    name = next(n for n in header if n.endswith("::exp_avg_sq"))
    assert header[name]["dtype"] == "U8"
    lo, hi = header[name]["data_offsets"]
    data[8 + head + (lo + hi) // 2] ^= 0x10  # one byte inside the compressed moment
    file.write_bytes(bytes(data))
    eng, _ = _engine("int8", "nvme", tmp_path / "load")
    try:
        with pytest.raises(engine.CheckpointError, match=rf"{file}.*corrupted"):
            eng.load_checkpoint(tmp_path / "ck", tag="t")
    finally:
        eng.close()


def test_consolidate_does_not_need_the_moments(tmp_path: Path) -> None:
    eng, model = _engine("int8", "nvme", tmp_path / "swap")
    try:
        _train(eng, 0, 3)
        eng.save_checkpoint(tmp_path / "ck", tag="t")
        want = full_params(eng, model)
    finally:
        eng.close()
    sd = engine.consolidate(tmp_path / "ck")
    assert want.keys() <= sd.keys()
    assert all(torch.equal(sd[k].to(torch.bfloat16).float(), want[k]) for k in want)


def test_manifest_with_an_unreadable_moment_layout_names_file_and_group(
        tmp_path: Path) -> None:
    """A moments entry the codec cannot decode (here a byte count off by one) is refused
    before anything is read, naming the manifest and the group, by load and consolidate."""
    path = _save_trained("int8", "cpu", tmp_path, n=1)
    manifest = json.loads((path / MANIFEST).read_text())
    group = next(g for g in manifest["groups"] if g.get("moments"))
    group["moments"]["nbytes"] += 1
    manifest[MANIFEST_CRC] = manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    want = rf"{MANIFEST}: group {group['key']!r}: .*the layout says"
    with pytest.raises(engine.CheckpointError, match=want):
        engine.consolidate(tmp_path / "ck", tag=path.name)
    eng, _ = _engine("int8", "cpu", tmp_path / "swap_load")
    try:
        with pytest.raises(engine.CheckpointError, match=want):
            eng.load_checkpoint(tmp_path / "ck", tag=path.name)
    finally:
        eng.close()


def test_stored_layout_pieces_and_manifest_checks() -> None:
    """int8 keeps its pieces (blocks restart at each); fp32 / bf16 are one piece; a layout
    this codec cannot have produced is refused, naming both values."""
    lay = sc.StoredLayout.of("int8", 2500, CHUNK)
    assert [p[:2] for p in lay.pieces()] == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert lay.nbytes == 2 * sc.moment_nbytes(1000, "int8") + sc.moment_nbytes(500, "int8")
    assert sc.StoredLayout.of("bf16", 2500, CHUNK).pieces() == [(0, 2500, 0, 5000)]
    assert sc.StoredLayout.from_json(lay.as_json()) == lay
    with pytest.raises(ValueError, match="blocks of 128 elements; this tierzero decodes"):
        sc.StoredLayout.from_json({**lay.as_json(), "block": 128})
    with pytest.raises(ValueError, match=f"take {lay.nbytes} bytes; the layout says 7"):
        sc.StoredLayout.from_json({**lay.as_json(), "nbytes": 7})
    x = torch.randn(2500).abs()
    raw = torch.empty(lay.nbytes, dtype=torch.uint8)
    lay.encode("exp_avg_sq", x, raw)
    back = torch.empty(2500)
    lay.decode("exp_avg_sq", raw, back)
    for lo, hi, a, b in lay.pieces():  # each piece is the codec's encoding of its elements
        want = torch.empty(b - a, dtype=torch.uint8)
        sc.encode("exp_avg_sq", x[lo:hi], want, "int8")
        assert torch.equal(raw[a:b], want)
    assert float(((back - x) / x).abs().max()) < 0.07
