"""offload.optimizer.state_precision in the engine: moments kept compressed on host and NVMe.

What is guaranteed and checked here: the streamed NVMe step and the in-place host step give
bit-identical results for a compressed precision (the same kernel over the same blocks, with
NVMe pieces a multiple of the block); the bytes across the disk fall; a checkpoint resumes
bit-exactly within a precision and converts (logged) between precisions; bad configs name
the key. fp32 itself is covered, unchanged, by the existing parity tests.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import resume_config
from engine_helpers import full_params, make_batches, make_model

from tierzero import engine
from tierzero.engine.config import Config, ConfigError
from tierzero.engine.config.load import load_config
from tierzero.offload import state_codec as sc

STEPS = 4


def _config(offload: str, swap: Path, prec: str, chunk: int | None = None) -> Config:
    cfg = resume_config("bf16", 1, offload, str(swap))
    opt = replace(cfg.offload.optimizer, state_precision=prec)  # type: ignore[arg-type]
    if chunk is not None:
        opt = replace(opt, chunk_numel=chunk)
    return replace(cfg, offload=replace(cfg.offload, optimizer=opt))


def _engine(cfg: Config) -> tuple[Any, torch.nn.Module]:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    return eng, model


def _train(eng: Any, start: int, stop: int) -> None:
    for ids, tg in make_batches(stop)[start:stop]:
        eng.backward(eng(ids, tg))
        eng.step()


def _disk_bytes(eng: Any) -> int:
    """NVMe bytes of the optimizer state (master and moments), both ways. Param reads are
    left out: how many a step makes depends on which pool buffers still hold a kept param
    ([Note: param kept in host memory] in offload/stream_parts.py), i.e. on timing."""
    moved = eng.store.tier_report()["moved_by_class"]
    return sum(int(moved[d].get(kind, 0)) for d in ("nvme_to_host", "host_to_nvme")
               for kind in ("master", "exp_avg", "exp_avg_sq"))


def _moments(eng: Any) -> dict[str, torch.Tensor]:
    """Every group's decoded moments, as fp32 copies."""
    out = {}
    for key in eng.store.group_keys():
        for kind in ("exp_avg", "exp_avg_sq"):
            if eng.store.has(key, kind):
                with eng.store.use(key, kind) as t:
                    out[f"{key}:{kind}"] = t.clone()
    return out


@pytest.mark.parametrize("prec", ["bf16", "int8"])
def test_nvme_stream_matches_host_in_place_and_moves_fewer_bytes(prec: str,
                                                                  tmp_path: Path) -> None:
    """NVMe pieces of 1024 elements (4 blocks; the shards are larger, so several pieces):
    the streamed step equals the in-place host step bit for bit."""
    runs: dict[str, Any] = {}
    for name, offload, p, chunk in (("host", "cpu", prec, None), ("nvme", "nvme", prec, 1024),
                                    ("nvme32", "nvme", "fp32", 1024)):
        eng, model = _engine(_config(offload, tmp_path / name, p, chunk))
        try:
            if name == "nvme":
                assert max(len(eng.store.pieces(k, "exp_avg"))
                           for k in eng.store.group_keys() if eng.store.has(k, "exp_avg")) > 1
            _train(eng, 0, STEPS)
            runs[name] = (full_params(eng, model),
                          _disk_bytes(eng) if offload == "nvme" else 0, _moments(eng))
        finally:
            eng.close()
    host, nvme, fp32 = runs["host"], runs["nvme"], runs["nvme32"]
    assert host[0].keys() == nvme[0].keys()
    assert all(torch.equal(host[0][k], nvme[0][k]) for k in host[0])
    # the moments differ by their pieces' blocks only where a piece boundary is not a block
    # boundary; 1024 is a multiple of the block, so they are the same
    assert all(torch.equal(host[2][k], nvme[2][k]) for k in host[2])
    # the state's bytes: 12 B/param fp32 each way -> 8 (bf16) / ~6 (int8)
    assert nvme[1] < (0.7 if prec == "bf16" else 0.55) * fp32[1]
    # and training tracks fp32
    diff = max(float((nvme[0][k] - fp32[0][k]).abs().max()) for k in fp32[0])
    assert 0 < diff < 0.05


@pytest.mark.parametrize(("prec", "offload"), [("int8", "nvme"), ("bf16", "cpu")])
def test_resume_is_bit_exact_within_a_precision(prec: str, offload: str,
                                                tmp_path: Path) -> None:
    n, m = 3, 3
    a, model_a = _engine(_config(offload, tmp_path / "a", prec))
    try:
        _train(a, 0, n)
        a.save_checkpoint(tmp_path / "ck", tag="t")
        _train(a, n, n + m)
        full = full_params(a, model_a)
        moments = _moments(a)
    finally:
        a.close()
    b, model_b = _engine(_config(offload, tmp_path / "b", prec))
    try:
        b.load_checkpoint(tmp_path / "ck", tag="t")
        _train(b, n, n + m)
        resumed = full_params(b, model_b)
        assert all(torch.equal(full[k], resumed[k]) for k in full)
        got = _moments(b)
        assert all(torch.equal(moments[k], got[k]) for k in moments)
    finally:
        b.close()
    manifest = (tmp_path / "ck" / "t" / "manifest.json").read_text()
    assert f'"state_precision": "{prec}"' in manifest


def test_checkpoints_convert_between_precisions(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """int8 -> fp32: the decoded moments exactly; fp32 -> int8: the moments encoded once,
    logged both ways."""
    a, _ = _engine(_config("nvme", tmp_path / "a", "int8"))
    try:
        _train(a, 0, 3)
        a.save_checkpoint(tmp_path / "ck", tag="q")
        saved_q = _moments(a)
    finally:
        a.close()
    b, _ = _engine(_config("nvme", tmp_path / "b", "fp32"))
    try:
        with caplog.at_level(logging.WARNING):
            b.load_checkpoint(tmp_path / "ck", tag="q")
        assert "kept its Adam moments as int8, this run keeps them as fp32" in caplog.text
        assert "exact" in caplog.text
        got = _moments(b)
        assert all(torch.equal(saved_q[k], got[k]) for k in saved_q)
        _train(b, 3, 5)
        b.save_checkpoint(tmp_path / "ck", tag="f")
        saved_f = _moments(b)
    finally:
        b.close()
    caplog.clear()
    c, _ = _engine(_config("cpu", tmp_path / "c", "int8"))
    try:
        with caplog.at_level(logging.WARNING):
            c.load_checkpoint(tmp_path / "ck", tag="f")
        assert "kept its Adam moments as fp32, this run keeps them as int8" in caplog.text
        assert "rounded once to int8" in caplog.text
        got = _moments(c)
        for k, v in saved_f.items():
            raw = torch.zeros(sc.moment_nbytes(v.numel(), "int8"), dtype=torch.uint8)
            want = torch.empty_like(v)
            sc.encode(k.rsplit(":", 1)[1], v, raw, "int8")
            sc.decode(k.rsplit(":", 1)[1], raw, want, "int8")
            assert torch.equal(got[k], want), k
        _train(c, 5, 6)  # and it trains on
    finally:
        c.close()


def test_config_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"offload\.optimizer\.state_precision.*'none'"):
        load_config({"zero": {"stage": 3}, "offload": {"optimizer": {
            "device": "none", "state_precision": "int8"}}})
    with pytest.raises(ConfigError, match=r"offload\.optimizer\.state_precision"):
        load_config({"zero": {"stage": 3}, "offload": {"optimizer": {
            "device": "cpu", "state_precision": "int4"}}})
    cfg = load_config({"zero": {"stage": 3}, "offload": {"optimizer": {
        "device": "cpu", "state_precision": "int8"}}})
    assert cfg.offload.optimizer.state_precision == "int8"
