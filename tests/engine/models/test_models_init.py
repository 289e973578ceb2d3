"""engine.Init: modules built inside hold per-rank shards, never their whole set of values
at once beyond zero.init_live_bytes; initial values equal an unpartitioned build with the
same seed (bitwise: the same init code draws the same random numbers); training from an
Init build equals training from a plain build (bitwise: identical shards)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import make_model, train_and_gather

from tierzero import engine
from tierzero.engine.collectives import Comm
from tierzero.engine.init.context import full_values, is_partitioned

N_BLOCKS = 6


def _cfg(max_live: int, units: tuple[str, ...] = ("Block",)) -> engine.Config:
    return engine.load_config({
        "zero": {"stage": 3, "units": list(units), "persistence_threshold_bytes": 0,
                 "max_live_bytes": max_live, "init_live_bytes": max_live},
        "precision": "fp32", "gradient_clipping": 0.5,
        "optimizer": {"type": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1}})


def init_scenario(rank: int) -> dict[str, object]:
    """One rank: build under Init (tight live bound), check the placeholders, train 3 steps;
    then the same with a plain build."""
    cfg = _cfg(max_live=8_000)
    with engine.Init(config=cfg) as ini:
        model = make_model(n_blocks=N_BLOCKS)  # also edits LayerNorms after construction
    placeholders = all(p.untyped_storage().nbytes() == 0 and is_partitioned(p)
                       for p in model.parameters())
    got = train_and_gather(model, cfg, seed=1 + rank)
    want = train_and_gather(make_model(n_blocks=N_BLOCKS), cfg, seed=1 + rank)
    torch.manual_seed(3)  # odd sizes: rank 1's slice is shorter than rank 0's (7*5 = 35)
    with engine.Init(config=_cfg(max_live=0)):
        odd = torch.nn.Linear(7, 5)
    odd_values = {k: full_values(p, Comm()).clone() for k, p in odd.named_parameters()}
    return {"got": got, "want": want, "placeholders": placeholders, "odd": odd_values,
            "peak_live": ini.peak_live_bytes, "gathers": ini.gathers}


def _largest_param_bytes(model: torch.nn.Module) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


def test_init_values_equal_plain_build_one_rank() -> None:
    ref = make_model(n_blocks=N_BLOCKS)
    with engine.Init(config=_cfg(max_live=8_000)) as ini:
        model = make_model(n_blocks=N_BLOCKS)
    for p in model.parameters():  # shape kept, no bytes held
        assert p.untyped_storage().nbytes() == 0 and is_partitioned(p)
    assert [p.shape for p in model.parameters()] == [p.shape for p in ref.parameters()]
    total = sum(p.numel() * 4 for p in ref.parameters())
    # the LRU holds at most the bound plus the one parameter that pushed it over
    assert ini.peak_live_bytes <= 8_000 + _largest_param_bytes(ref) < total
    assert ini.gathers > 0  # make_model's LayerNorm edits ran on partitioned parameters
    eng, _, _, _ = engine.initialize(model=model, config=_cfg(8_000), device="cpu")
    assert not any(is_partitioned(p) for p in model.parameters())  # handed to the engine
    with engine.GatheredParameters(list(model.parameters())):
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), k
    eng.close()


def test_init_disabled_below_stage_3() -> None:
    cfg = engine.load_config({"zero": {"stage": 2}})
    with engine.Init(config=cfg):
        lin = torch.nn.Linear(4, 4)
    assert lin.weight.untyped_storage().nbytes() == 16 * 4 and not is_partitioned(lin.weight)


def test_init_data_assignment_inside_context() -> None:
    """`module.to(dtype)` inside Init replaces `.data`: the new values are what is kept."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8).to(torch.float64)
    torch.manual_seed(0)
    with engine.Init(config=_cfg(max_live=0)):
        lin = torch.nn.Linear(8, 8).to(torch.float64)
    assert lin.weight.dtype == torch.float64 and is_partitioned(lin.weight)
    assert torch.equal(full_values(lin.weight, Comm()).view(8, 8), ref.weight.detach())


@pytest.mark.multiproc
def test_init_two_ranks_train_equal_to_plain_build(tmp_path: Path) -> None:
    results = run_two_ranks(tmp_path, {"init": partial(init_scenario)})
    ref = make_model(n_blocks=N_BLOCKS)
    total = sum(p.numel() * 4 for p in ref.parameters())
    for rank in range(2):
        r = results[rank]["init"]
        assert r["placeholders"]
        assert r["peak_live"] <= 8_000 + _largest_param_bytes(ref) < total
        assert r["got"]["losses"] == r["want"]["losses"]
        for k, want in r["want"]["params"].items():
            assert torch.equal(r["got"]["params"][k], want), (rank, k)
    torch.manual_seed(3)
    odd = torch.nn.Linear(7, 5)
    for rank in range(2):
        for k, p in odd.named_parameters():
            assert torch.equal(results[rank]["init"]["odd"][k], p.detach().reshape(-1)), k
    start = dict(ref.named_parameters())
    moved = max(float((results[0]["init"]["got"]["params"][k] - start[k].detach()).abs().max())
                for k in start)
    assert moved > 1e-3  # training moved the parameters, so equality says something


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_hf_values_equal_plain_build(arch: str) -> None:
    """Hugging Face `post_init` re-initialises every weight after construction; under Init it
    runs on partitioned parameters (gathered on access) and gives the same values."""
    transformers = pytest.importorskip("transformers")

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        if arch == "llama":
            c = transformers.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
            return transformers.LlamaForCausalLM(c)  # type: ignore[no-any-return]
        c = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                    n_positions=32, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(c)  # type: ignore[no-any-return]

    ref = build()
    with engine.Init(config=_cfg(max_live=20_000)) as ini:
        model = build()
    assert all(is_partitioned(p) for p in model.parameters())
    assert ini.peak_live_bytes < sum(p.numel() * 4 for p in ref.parameters())
    eng, _, _, _ = engine.initialize(model=model, config=_cfg(20_000, units=()),
                                     device="cpu")
    with engine.GatheredParameters(list(model.parameters())):
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), k
    eng.close()
