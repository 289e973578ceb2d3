"""Corruption is never silent: a flipped bit in a swap file under the default config, an
edited checkpoint manifest (issue 21, "Done when": bit flip, manifest edit)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
from engine_helpers import make_batches, make_config, make_model, train_steps

from tierzero import engine
from tierzero.engine.checkpoint.layout import MANIFEST, MANIFEST_CRC
from tierzero.engine.config import Config, load_config
from tierzero.swap.header import HEADER_BYTES, Header

pytestmark = pytest.mark.faults


def _default_nvme(path: Path) -> Config:
    """The tiny test model's config with the NVMe section exactly as a user gets it."""
    defaults = load_config({"offload": {"device": "nvme", "path": str(path),
                                        "budgets": {"device_bytes": 64 << 10}}})
    return dataclasses.replace(make_config(), offload=defaults.offload, nvme=defaults.nvme)


def _live_regions(swap_file: Path) -> dict[str, tuple[int, Header]]:
    """key -> (offset, header) of the newest region of each key (copy-on-write leaves old
    regions behind; the newest generation is the one the store reads)."""
    data = swap_file.read_bytes()
    found: dict[str, tuple[int, Header]] = {}
    for at in range(0, len(data) - HEADER_BYTES + 1, 4096):
        try:
            h = Header.unpack(memoryview(data)[at:at + HEADER_BYTES])
        except ValueError:
            continue
        if h.key not in found or found[h.key][1].generation < h.generation:
            found[h.key] = (at, h)
    return found


def test_default_config_checks_swap_blocks() -> None:
    assert load_config({}).nvme.verify is True


def test_bit_flip_in_a_swap_file_is_an_error_naming_file_and_key(tmp_path: Path) -> None:
    cfg = _default_nvme(tmp_path)
    eng, _, _, _ = engine.initialize(model=make_model(), config=cfg, device="cpu")
    batches = make_batches(3)
    try:
        train_steps(eng, batches[:1])
        # the step's writes may still be in flight (pipeline_write) and a read-ahead may
        # already hold the next step's state: after flush() the newest region of each key
        # on disk is the one the next step reads
        eng.step_driver.flush()
        (swap_file,) = tmp_path.rglob("*.swp")
        regions = _live_regions(swap_file)
        masters = sorted(k for k in regions if "master" in k)
        assert masters, sorted(regions)
        offset, header = regions[masters[0]]
        with open(swap_file, "r+b") as f:  # one bit of one fp32 master element
            at = offset + HEADER_BYTES + header.nbytes // 2
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x04]))
        with pytest.raises(Exception, match="corrupted") as info:
            train_steps(eng, batches[1:])
        msg = str(info.value)
        assert str(swap_file) in msg and masters[0] in msg, msg
    finally:
        eng.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    eng, _, _, _ = engine.initialize(model=make_model(), config=make_config(), device="cpu")
    train_steps(eng, make_batches(2))
    root = tmp_path_factory.mktemp("ckpt")
    eng.save_checkpoint(root, tag="t")
    eng.close()
    return root


def _edit_manifest(root: Path, edit: str) -> None:
    file = root / "t" / MANIFEST
    text = file.read_text()
    if edit == "lr digit":  # what the issue saw: base_lrs 0.01 -> 0.02, loads silently
        m = re.search(r'"base_lrs": \[\s*([0-9.e-]+)', text)
        assert m is not None, text[:400]
        start = m.start(1) + m.group(1).index("1")
        text = text[:start] + "2" + text[start + 1:]
    elif edit == "file crc":
        manifest = json.loads(text)
        name = sorted(manifest["files"])[0]
        manifest["files"][name]["crc32"] ^= 1
        text = json.dumps(manifest, indent=1)
    elif edit == "checksum removed":
        manifest = json.loads(text)
        del manifest[MANIFEST_CRC]
        text = json.dumps(manifest, indent=1)
    file.write_text(text)


@pytest.mark.parametrize("edit", ["lr digit", "file crc", "checksum removed"])
def test_edited_manifest_is_refused(saved: Path, tmp_path: Path, edit: str) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    _edit_manifest(root, edit)
    eng, _, _, _ = engine.initialize(model=make_model(seed=5), config=make_config(),
                                     device="cpu")
    try:
        with pytest.raises(engine.CheckpointError, match=rf"{root / 't' / MANIFEST}.*"
                           r"(edited|no 'manifest_crc32')"):
            eng.load_checkpoint(root, "t")
        with pytest.raises(engine.CheckpointError, match=r"edited|no 'manifest_crc32'"):
            engine.consolidate(root, "t")
    finally:
        eng.close()


def test_untouched_manifest_loads(saved: Path) -> None:
    eng, _, _, _ = engine.initialize(model=make_model(seed=5), config=make_config(),
                                     device="cpu")
    try:
        eng.load_checkpoint(saved, "t")
        assert eng.global_steps == 2
    finally:
        eng.close()
