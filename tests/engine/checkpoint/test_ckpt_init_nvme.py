"""engine.Init with offload.params.device nvme: each parameter's slice goes to NVMe as the
module is built (no host copy kept); values and training stay bitwise equal to a plain build
with the same seed (the same init code draws the same numbers; the swap file returns the
bytes written). Also the progress-bar rule for Init and checkpoints."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import make_model, train_and_gather
from safetensors.torch import save_file

from tierzero import engine
from tierzero.engine.init.context import _record, is_partitioned
from tierzero.engine.progress import ENV, progress_enabled

N_BLOCKS = 6


def _cfg(swap: Path, max_live: int = 8_000, progress: str = "auto") -> engine.Config:
    swap.mkdir(exist_ok=True)
    return engine.load_config({
        "zero": {"stage": 3, "units": ["Block"], "persistence_threshold_bytes": 0,
                 "max_live_bytes": max_live, "init_live_bytes": max_live},
        "precision": "fp32", "gradient_clipping": 0.5,
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "offload": {"device": "nvme", "path": str(swap)},
        "logging": {"progress": progress}})


def _swap_files(swap: Path) -> list[Path]:
    return sorted(swap.rglob("*.swp"))


def test_init_slices_go_to_nvme_and_values_equal_plain_build(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "swap")
    ref = make_model(n_blocks=N_BLOCKS)
    with engine.Init(config=cfg) as ini:
        model = make_model(n_blocks=N_BLOCKS)  # also edits LayerNorms after construction
    slices = 0
    for p in model.parameters():
        rec = _record(p)
        assert rec is not None and is_partitioned(p) and p.untyped_storage().nbytes() == 0
        assert rec.shard is None and rec.nvme is not None  # no host copy of the slice
        slices += rec.chunk * p.element_size()
    # every slice was written (some twice: partitioned again after make_model's edits)
    assert ini.nvme_bytes >= slices >= sum(p.numel() * 4 for p in ref.parameters())
    assert len(_swap_files(tmp_path / "swap")) == 1  # Init's staging file
    got = train_and_gather(model, cfg)
    assert len(_swap_files(tmp_path / "swap")) == 0  # every slice consumed, file removed
    want = train_and_gather(ref, cfg)
    assert got["losses"] == want["losses"]
    assert all(torch.equal(v, want["params"][k]) for k, v in got["params"].items())


def nvme_init_scenario(rank: int, swap: str) -> dict[str, object]:
    """One of two ranks: build under Init onto NVMe (this rank's own swap directory), train;
    the same from a plain build."""
    cfg = _cfg(Path(swap) / f"rank{rank}")
    with engine.Init(config=cfg) as ini:
        model = make_model(n_blocks=N_BLOCKS)
    on_nvme = all((rec := _record(p)) is not None and rec.nvme is not None
                  for p in model.parameters())
    return {"got": train_and_gather(model, cfg),
            "want": train_and_gather(make_model(n_blocks=N_BLOCKS), cfg),
            "on_nvme": on_nvme, "nvme_bytes": ini.nvme_bytes}


@pytest.mark.multiproc
def test_init_onto_nvme_two_ranks(tmp_path: Path) -> None:
    """Each rank stages its own slices; accesses during construction all-gather them from
    the two ranks' files. Training equals a plain build on both ranks, bitwise."""
    (tmp_path / "swap").mkdir()
    results = run_two_ranks(tmp_path, {"init": partial(nvme_init_scenario,
                                                       swap=str(tmp_path / "swap"))})
    for rank in range(2):
        r = results[rank]["init"]
        assert r["on_nvme"] and r["nvme_bytes"] > 0
        assert r["got"]["losses"] == r["want"]["losses"]
        for k, want in r["want"]["params"].items():
            assert torch.equal(r["got"]["params"][k], want), (rank, k)


def test_load_pretrained_into_nvme_slices(tmp_path: Path) -> None:
    """load_pretrained on an Init-built model before initialize writes into the slices on
    NVMe: the engine then holds the pretrained values exactly."""
    src = make_model(seed=7, n_blocks=2)
    (tmp_path / "hf").mkdir()
    save_file({k: v.detach().contiguous() for k, v in src.state_dict().items()},
              str(tmp_path / "hf" / "model.safetensors"))
    cfg = _cfg(tmp_path / "swap")
    with engine.Init(config=cfg):
        model = make_model(seed=0, n_blocks=2)
    engine.load_pretrained(model, tmp_path / "hf")
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        with engine.GatheredParameters(list(model.parameters())):
            for (k, p), q in zip(model.named_parameters(), src.parameters(), strict=True):
                assert torch.equal(p, q), k
    finally:
        eng.close()


def test_progress_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert progress_enabled("on") and not progress_enabled("off")
    assert not progress_enabled("on", rank=1)  # rank 0 only
    monkeypatch.setenv(ENV, "0")
    assert not progress_enabled("on")
    monkeypatch.setenv(ENV, "1")
    assert progress_enabled("off") and not progress_enabled("auto", rank=2)


def test_progress_bars_for_init_and_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    for setting, shown in (("off", False), ("auto", False), ("on", True)):  # stderr: no TTY
        cfg = _cfg(tmp_path / f"swap-{setting}", progress=setting)
        with engine.Init(config=cfg):
            model = make_model(n_blocks=2)
        eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
        eng.save_checkpoint(tmp_path / f"ck-{setting}", tag="t")
        eng.load_checkpoint(tmp_path / f"ck-{setting}", tag="t")
        eng.close()
        err = capsys.readouterr().err
        for desc in ("Init -> NVMe", "save t", "load t"):
            assert (desc in err) == shown, (setting, desc, err)
