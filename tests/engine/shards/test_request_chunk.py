"""The default piece of streamed optimizer state ([Note: a moment piece is one request] in
engine/shards/tier_config.py): with offload.optimizer.chunk_numel unset, a piece has the
most elements, a multiple of the int8 codec's block, whose one moment fits one
nvme.block_size request; a chunk_numel that is set is kept; state the CPU Adam does not
stream is not cut."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierzero import engine
from tierzero.engine.shards.tier_config import chunk_numel, homes_from, request_chunk_numel
from tierzero.offload.state_codec import BLOCK, moment_nbytes


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("block", [4096, 1 << 20, 3 << 20, 4 << 20, 8 << 20])
def test_a_default_piece_is_the_most_codec_blocks_whose_moment_fits_one_request(
        precision: str, block: int) -> None:
    n = request_chunk_numel(block, precision)
    assert n % BLOCK == 0
    assert moment_nbytes(n, precision) <= block < moment_nbytes(n + BLOCK, precision)


def _chunk(tmp_path: Path, optimizer: dict[str, Any], **nvme: Any) -> int:
    config = engine.load_config({
        "precision": {"dtype": "bf16"},
        "offload": {"params": {"device": "nvme", "path": str(tmp_path)},
                    "optimizer": {"path": str(tmp_path), **optimizer}},
        "nvme": nvme})
    return chunk_numel(config, homes_from(config))


def test_the_config_default_follows_the_block_size_and_the_state_precision(
        tmp_path: Path) -> None:
    nvme = {"device": "nvme"}
    assert _chunk(tmp_path, nvme) == 1 << 20  # fp32 moments: 4 B each, 4 MiB requests
    assert _chunk(tmp_path, {**nvme, "state_precision": "bf16"}) == 2 << 20
    int8 = _chunk(tmp_path, {**nvme, "state_precision": "int8"})
    assert int8 == request_chunk_numel(4 << 20, "int8") and 4_000_000 < int8 < 4 << 20
    assert _chunk(tmp_path, {**nvme, "state_precision": "int8"}, block_size=1 << 20) \
        == request_chunk_numel(1 << 20, "int8")
    assert _chunk(tmp_path, {**nvme, "state_precision": "int8", "chunk_numel": 1 << 20}) \
        == 1 << 20  # set: kept
    assert _chunk(tmp_path, {"device": "cpu"}) == 0  # updated in place: no pieces
