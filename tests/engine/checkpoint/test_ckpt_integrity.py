"""Bad checkpoints and bad requests fail loudly, naming the file or value and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import full_params, make_batches, make_config, make_model

from tierzero import engine
from tierzero.engine.checkpoint import save as ckpt_mod
from tierzero.engine.checkpoint.layout import LATEST, rank_file
from tierzero.engine.checkpoint.state import persistent_buffers


def _trained(precision: str = "fp32", n_blocks: int = 4) -> tuple[engine.ZeroEngine,
                                                                   torch.nn.Module]:
    model = make_model(n_blocks=n_blocks)
    eng, _, _, _ = engine.initialize(model=model, config=make_config(precision=precision),
                                     device="cpu")
    for ids, tg in make_batches(2):
        eng.backward(eng(ids, tg))
        eng.step()
    return eng, model


class Opaque:
    """Picklable, but not a type torch.load(weights_only=True) accepts."""


def _fresh(precision: str = "fp32", n_blocks: int = 4) -> engine.ZeroEngine:
    eng, _, _, _ = engine.initialize(model=make_model(seed=7, n_blocks=n_blocks),
                                     config=make_config(precision=precision), device="cpu")
    return eng


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    eng, _ = _trained()
    root = tmp_path_factory.mktemp("ckpt")
    eng.save_checkpoint(root)
    eng.close()
    return root


def _copy(saved: Path, tmp: Path) -> Path:
    import shutil
    shutil.copytree(saved, tmp / "c")
    return tmp / "c"


def test_flipped_byte_is_detected_naming_the_file(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    f = root / "global_step2" / rank_file(0)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the shard data, not the header
    f.write_bytes(bytes(data))
    eng = _fresh()
    before = full_params(eng, eng.module)
    with pytest.raises(engine.CheckpointError, match=rf"{f}.*corrupted"):
        eng.load_checkpoint(root)
    after = full_params(eng, eng.module)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was changed


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_shard_is_detected_naming_the_file(saved: Path, tmp_path: Path,
                                                     verify: bool) -> None:
    root = _copy(saved, tmp_path)
    f = root / "global_step2" / rank_file(0)
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(engine.CheckpointError, match=rf"{f} is \d+ bytes.*truncated"):
        _fresh().load_checkpoint(root, verify=verify)


def test_missing_latest_and_incomplete_tag(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    (root / LATEST).unlink()
    with pytest.raises(engine.CheckpointError, match=r"latest is missing.*global_step2"):
        _fresh().load_checkpoint(root)
    (root / ".x.partial").mkdir()
    with pytest.raises(engine.CheckpointError, match="not a complete checkpoint"):
        _fresh().load_checkpoint(root, tag="x")
    _fresh().load_checkpoint(root, tag="global_step2")


def test_other_model_or_precision_is_refused(saved: Path) -> None:
    with pytest.raises(engine.CheckpointError, match="different model layout"):
        _fresh(n_blocks=3).load_checkpoint(saved)
    with pytest.raises(engine.CheckpointError, match=r"compute dtype torch\.float32"):
        _fresh(precision="bf16").load_checkpoint(saved)


def test_save_refusals(tmp_path: Path) -> None:
    eng, _ = _trained()
    eng.save_checkpoint(tmp_path, tag="a")
    with pytest.raises(engine.CheckpointError, match="already exists"):
        eng.save_checkpoint(tmp_path, tag="a")
    with pytest.raises(ValueError, match=r"tag '\.\./x' is not allowed"):
        eng.save_checkpoint(tmp_path, tag="../x")
    class Local:  # cannot even be pickled
        pass

    for bad in (Opaque(), Local()):
        with pytest.raises(engine.CheckpointError, match="weights_only=True"):
            eng.save_checkpoint(tmp_path, tag="b", client_state={"obj": bad})
    assert not (tmp_path / "b").exists()
    assert (tmp_path / LATEST).read_text() == "a"


def test_stale_partial_save_is_replaced(tmp_path: Path) -> None:
    eng, model = _trained()
    stale = tmp_path / ".s.partial"
    stale.mkdir(parents=True)
    (stale / rank_file(0)).write_bytes(b"junk from a killed save")
    eng.save_checkpoint(tmp_path, tag="s")
    assert not stale.exists()
    want = full_params(eng, model)
    fresh = _fresh()
    fresh.load_checkpoint(tmp_path)
    got = full_params(fresh, fresh.module)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_module_buffers_round_trip(tmp_path: Path) -> None:
    """Persistent buffers (BatchNorm running statistics) are saved, loaded, consolidated."""
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                   torch.nn.Linear(8, 1))

    model = build()
    eng, _, _, _ = engine.initialize(model=model, config=make_config(units=("Linear",)),
                                     device="cpu")
    x = torch.randn(16, 8)
    eng.backward(eng(x).sum())
    eng.step()
    eng.save_checkpoint(tmp_path)
    mean = model[1].running_mean.clone()
    assert not torch.equal(mean, torch.zeros(8))
    model2 = build()
    eng2, _, _, _ = engine.initialize(model=model2, config=make_config(units=("Linear",)),
                                      device="cpu")
    eng2.load_checkpoint(tmp_path)
    assert torch.equal(model2[1].running_mean, mean)
    assert int(model2[1].num_batches_tracked) == 1
    sd = engine.consolidate(tmp_path)
    assert torch.equal(sd["1.running_mean"], mean)
    assert sd["1.num_batches_tracked"].dtype == torch.int64


def test_persistent_buffers_are_the_state_dict_buffers() -> None:
    """The buffers a checkpoint saves are found without module.state_dict() (whose engine
    hook waits for a deferred optimizer update), and are exactly those a state_dict holds:
    nested ones, and none registered persistent=False."""
    m = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Sequential(torch.nn.BatchNorm1d(2)))
    m[1].register_buffer("scratch", torch.zeros(3), persistent=False)
    m.register_buffer("top", torch.ones(1))
    names = set(persistent_buffers(m))
    assert names == {k for k in m.state_dict() if k in dict(m.named_buffers())}
    assert "1.scratch" not in names and {"top", "1.0.running_mean"} <= names


def test_background_save_holds_the_state_at_the_call(tmp_path: Path) -> None:
    eng, model = _trained()
    want = full_params(eng, model)
    pending = eng.save_checkpoint(tmp_path, tag="bg", background=True)
    for ids, tg in make_batches(3, seed=5):  # the shards change while the save is written
        eng.backward(eng(ids, tg))
        eng.step()
    assert isinstance(pending, engine.PendingSave)
    assert pending.wait() == tmp_path / "bg"
    assert (tmp_path / LATEST).read_text() == "bg"
    fresh = _fresh()
    fresh.load_checkpoint(tmp_path)
    got = full_params(fresh, fresh.module)
    assert all(torch.equal(want[k], got[k]) for k in want)
    moved = full_params(eng, model)
    assert any(not torch.equal(want[k], moved[k]) for k in want)
    eng.close()


def test_background_save_error_surfaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    """A write failure in the worker thread reaches wait() (and close()); latest stays."""
    eng, _ = _trained()
    eng.save_checkpoint(tmp_path, tag="x", background=True)

    def failing(path: Path, payload: object, desc: str, pacer: object = None
                ) -> dict[str, int]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod, "_write_rank_file", failing)
    pending = eng.save_checkpoint(tmp_path, tag="y", background=True)  # waits for "x" first
    assert isinstance(pending, engine.PendingSave)
    with pytest.raises(engine.CheckpointError, match=r"rank00000\.safetensors.*No space left"):
        pending.wait()
    assert (tmp_path / LATEST).read_text() == "x"
    eng.close()
