"""Mixture-of-experts on two gloo ranks whose tokens choose different experts.

Leaf modules are never split across units ([Note: units and rank divergence] in
engine/units.py): a config that asks for per-expert units still gets one unit per MoE
block, and the result matches a single-process plain-PyTorch run over the same global
batch (both ranks' batches in one forward). What can still diverge is an error on every
rank naming the units ([Note: collective order check] in engine/collectives.py).

Tolerances: the custom MoE's every parameter has a real gradient (top-1 softmax gate,
no renormalisation), compared at the parity tolerances of test_engine_parity.py. The
transformers MoE blocks renormalise their top-k weights, so router rows of experts no
token chose have rounding-noise gradients that Adam turns into lr-sized steps; those
elements are bounded by Adam's step size and the rest compared at 2e-4, as in
test_models_hf.py's Mixtral AdamW test.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_dist import run_two_ranks, spawn_two
from engine_helpers import LOSS_RTOL, PARAM_ATOL, full_params
from torch import nn

from tierzero import RanksDivergedError, engine
from tierzero.engine.collectives import Comm
from tierzero.engine.config import Config

VOCAB, DIM, SEQ, BATCH = 64, 16, 6, 2
N_EXPERTS = 4
STEPS = 3
LR = 1e-2
HF_ATOL = 2e-4  # transformers MoE, non-noise elements (see the module docstring)
NOISE_GRAD = 1e-8


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C) -> (N, C)
        return self.down(nn.functional.gelu(self.up(x)))  # type: ignore[no-any-return]


class Top1MoE(nn.Module):
    """Top-1 MoE: each token goes to the expert `route` names, scaled by the router's
    softmax probability of that expert; only experts that get a token run."""

    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])  # (N, C)
        gate = self.router(h).softmax(-1).gather(1, route.reshape(-1, 1))  # (N, 1)
        out = torch.zeros_like(h)
        for e in route.unique().tolist():
            mask = route.reshape(-1) == e
            out[mask] = self.experts[e](h[mask]) * gate[mask]
        return x + out.reshape(x.shape)


class MoELM(nn.Module):
    """Embedding, two Top1MoE layers, head. A token's expert is fixed by its id
    (id * N_EXPERTS // VOCAB), so rank 0 (ids below VOCAB/2) uses experts 0 and 1 and
    rank 1 uses 2 and 3: the ranks route to disjoint experts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Top1MoE(DIM, N_EXPERTS) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        route = ids * N_EXPERTS // VOCAB  # (B, T)
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, route)
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_moe() -> MoELM:
    torch.manual_seed(0)
    return MoELM()


def moe_batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r's tokens lie in [r * VOCAB/2, (r + 1) * VOCAB/2)."""
    g = torch.Generator().manual_seed(1 + rank)
    half = VOCAB // 2
    out = []
    for _ in range(n):
        ids = torch.randint(0, half, (BATCH, SEQ), generator=g) + rank * half
        out.append((ids, (ids * 5 + 1) % VOCAB))
    return out


def _config(offload: str, gas: int, path: Path, units: list[str],
            extra: dict[str, Any] | None = None) -> Config:
    zero: dict[str, Any] = {"stage": 3, "persistence_threshold_bytes": 0, "units": units,
                            "collective_timeout_s": 60, **(extra or {})}
    raw: dict[str, Any] = {"zero": zero, "precision": "fp32",
                           "batch": {"gradient_accumulation_steps": gas},
                           "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.1}}
    if offload != "none":
        where = {"device": offload, **({"path": str(path)} if offload == "nvme" else {})}
        raw["offload"] = {"params": where, "optimizer": where}
    return engine.load_config(raw)


def _mean_loss(comm: Comm, loss: torch.Tensor) -> float:
    val = loss.detach().float().reshape(1).clone()
    comm.all_reduce_sum(val)
    return float(val) / comm.world_size


def moe_scenario(rank: int, *, offload: str, gas: int, tmp: Path) -> dict[str, Any]:
    """The custom MoE asking for per-expert units (zero.units: [Expert])."""
    path = tmp / f"moe-{offload}-{gas}-r{rank}"
    path.mkdir(parents=True, exist_ok=True)
    model = make_moe()
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=_config(offload, gas, path, ["Expert"]))
    comm = Comm()
    losses = []
    for ids, tg in moe_batches(rank, STEPS * gas):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(_mean_loss(comm, loss))
    out = {"losses": losses, "params": full_params(eng, model),
           "units": [u.label for u in eng.units],
           "dynamic": [u.label for u in eng.units if u.dynamic]}
    eng.close()
    return out


def moe_reference(gas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch AdamW over the global batch (both ranks' batches in one forward)."""
    model = make_moe()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    per_rank = [moe_batches(r, STEPS * gas) for r in range(2)]
    losses = []
    for micro in range(STEPS * gas):
        ids = torch.cat([per_rank[r][micro][0] for r in range(2)])
        tg = torch.cat([per_rank[r][micro][1] for r in range(2)])
        loss = model(ids, tg)
        (loss / gas).backward()
        losses.append(float(loss.detach()))
        if (micro + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# -- transformers MoE models ---------------------------------------------------------------

def _hf_model(arch: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64,
                  attn_implementation="eager")
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(cfg)  # type: ignore[no-any-return]
    cfg = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, **common)
    return transformers.Qwen2MoeForCausalLM(cfg)  # type: ignore[no-any-return]


def hf_batches(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randint(0, 128, (1, 8), generator=g) for _ in range(n)]


def hf_scenario(rank: int, *, arch: str, offload: str, gas: int, units: list[str],
                tmp: Path) -> dict[str, Any]:
    path = tmp / f"{arch}-{offload}-{gas}-r{rank}"
    path.mkdir(parents=True, exist_ok=True)
    model = _hf_model(arch)
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=_config(offload, gas, path, units))
    comm = Comm()
    losses = []
    for ids in hf_batches(rank, STEPS * gas):
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        losses.append(_mean_loss(comm, loss))
    out = {"losses": losses, "params": full_params(eng, model),
           "dynamic": [u.label for u in eng.units if u.dynamic]}
    eng.close()
    return out


def hf_reference(arch: str, gas: int) -> tuple[list[float], dict[str, torch.Tensor],
                                               dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain PyTorch AdamW over the global batch; also the initial parameters and the
    largest gradient each element saw (for the noise rule)."""
    model = _hf_model(arch)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    per_rank = [hf_batches(r, STEPS * gas) for r in range(2)]
    losses, gmax = [], {k: torch.zeros_like(v) for k, v in start.items()}
    for micro in range(STEPS * gas):
        ids = torch.cat([per_rank[r][micro] for r in range(2)])
        loss = model(input_ids=ids, labels=ids).loss
        (loss / gas).backward()
        losses.append(float(loss.detach()))
        if (micro + 1) % gas == 0:
            for k, p in model.named_parameters():
                if p.grad is not None:
                    gmax[k] = torch.maximum(gmax[k], p.grad.detach().abs())
                else:
                    p.grad = torch.zeros_like(p)  # the engine's zero gradient
            opt.step()
            opt.zero_grad()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return losses, params, start, gmax


MOE_CASES = [("none", 1), ("cpu", 2), ("nvme", 1), ("none", 2), ("cpu", 1), ("nvme", 2)]
# (arch, offload, gas, zero.units): per-expert units asked for, or the model's own blocks
HF_CASES = [("mixtral", "none", 1, ["MixtralExperts"]), ("mixtral", "nvme", 2, []),
            ("qwen2_moe", "cpu", 2, ["Qwen2MoeExperts"]), ("qwen2_moe", "none", 1, [])]


@pytest.mark.multiproc
def test_moe_two_ranks_match_global_batch(tmp_path: Path) -> None:
    scenarios: dict[str, Any] = {
        f"moe-{o}-{g}": partial(moe_scenario, offload=o, gas=g, tmp=tmp_path)
        for o, g in MOE_CASES}
    for arch, o, g, units in HF_CASES:
        scenarios[f"{arch}-{o}-{g}"] = partial(hf_scenario, arch=arch, offload=o, gas=g,
                                               units=units, tmp=tmp_path)
    results = run_two_ranks(tmp_path, scenarios)
    for name in scenarios:  # both ranks hold the same model
        for k, v in results[0][name]["params"].items():
            assert torch.equal(v, results[1][name]["params"][k]), (name, k)
    start = dict(make_moe().named_parameters())
    for offload, gas in MOE_CASES:
        got = results[0][f"moe-{offload}-{gas}"]
        # one unit per MoE layer, whatever zero.units asked for; reduced at the end
        assert got["units"] == ["layers.0", "layers.1", "<root>"]
        assert got["dynamic"] == ["layers.0", "layers.1"]
        ref_losses, ref = moe_reference(gas)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                                   rtol=LOSS_RTOL, atol=0.0)
        for k, want in ref.items():
            torch.testing.assert_close(got["params"][k], want, rtol=0.0, atol=PARAM_ATOL,
                                       msg=f"{offload} gas {gas} {k}")
            moved = float((want - start[k].detach()).abs().max())
            assert moved > 100 * PARAM_ATOL, k  # every expert trained (on one rank only)
    for arch, offload, gas, units in HF_CASES:
        got = results[0][f"{arch}-{offload}-{gas}"]
        # the MoE block is the unit when the experts were asked for, else the decoder layer
        # (_no_split_modules) holding it
        suffix = ".mlp" if units else ""
        assert got["dynamic"] == [f"model.layers.{i}{suffix}" for i in range(2)]
        ref_losses, ref, hf_start, gmax = hf_reference(arch, gas)
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                                   rtol=LOSS_RTOL, atol=0.0)
        for k, want in ref.items():
            diff = (got["params"][k] - want).abs()
            noise = (gmax[k] > 0) & (gmax[k] <= NOISE_GRAD)
            if noise.any():
                assert ".gate." in k or k.endswith(".gate.weight"), (arch, k)  # routers only
                assert float(diff[noise].max()) <= 2 * STEPS * LR, (arch, k)
            assert float(diff[~noise].max()) <= HF_ATOL, (arch, offload, gas, k,
                                                          float(diff[~noise].max()))
            assert float((want - hf_start[k]).abs().max()) > 10 * HF_ATOL, (arch, k)


def test_per_expert_units_are_merged_into_the_moe_block() -> None:
    """One rank: the unit rules that would split an MoE block (zero.units naming the
    experts, the size rule) give one unit per block, logged; with auto_leaf_moe off the
    experts are units, and zero.leaf_modules names a class to keep whole."""
    def units(zero: dict[str, Any]) -> list[tuple[str, bool]]:
        cfg = engine.load_config({"zero": {"stage": 3, **zero}, "precision": "fp32"})
        eng, _, _, _ = engine.initialize(device="cpu", model=make_moe(), config=cfg)
        out = [(u.label, u.dynamic) for u in eng.units]
        eng.close()
        return out

    whole = [("layers.0", True), ("layers.1", True), ("<root>", False)]
    assert units({"units": ["Expert"]}) == whole
    by_size = units({"unit_min_bytes": 1})  # the size rule picks Linears inside
    assert by_size == [("emb", False), ("layers.0", True), ("layers.1", True),
                       ("head", False), ("<root>", False)]
    split = units({"units": ["Expert"], "auto_leaf_moe": False})
    assert [n for n, _ in split] == [f"layers.{i}.experts.{e}" for i in range(2)
                                     for e in range(N_EXPERTS)] + ["<root>"]
    assert units({"units": ["Expert"], "auto_leaf_moe": False,
                  "leaf_modules": ["Top1MoE"]}) == whole


# -- divergence: an error on every rank, never a hang -----------------------------------------

DIVERGE_TIMEOUT_S = 60.0


def _diverge_worker(rank: int, init_file: str, out_dir: str, case: str) -> None:
    """Runs outside engine_dist's harness: after a divergence the process group holds
    collectives that will never complete, so there is no barrier or clean shutdown."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    result: dict[str, Any] = {}
    start = time.monotonic()
    try:
        if case == "experts":  # per-expert units, MoE kept whole switched off
            cfg = engine.load_config({"zero": {
                "stage": 3, "persistence_threshold_bytes": 0, "units": ["Expert"],
                "auto_leaf_moe": False, "collective_timeout_s": DIVERGE_TIMEOUT_S},
                "precision": "fp32"})
            eng, _, _, _ = engine.initialize(device="cpu", model=make_moe(), config=cfg)
            ids, tg = moe_batches(rank, 1)[0]
            eng.backward(eng(ids, tg))
        else:  # "timeout": rank 0 gathers a unit rank 1 never gathers
            comm = Comm(check_order=True, timeout_s=2.0)
            if rank == 0:
                comm.all_gather(torch.empty(8), torch.ones(4), "blocks.7/float32/trainable")
            else:  # alive, never gathering, until rank 0 is done (6 s at most)
                while (not (Path(out_dir) / "rank0.pt").exists()
                       and time.monotonic() - start < 6.0):
                    time.sleep(0.02)  # another process's file: no event to block on
        result["error"] = None
    except RanksDivergedError as exc:
        result["error"] = str(exc)
    result["seconds"] = time.monotonic() - start
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_diverge(tmp: Path, case: str) -> list[dict[str, Any]]:
    spawn_two(_diverge_worker, str(tmp / "pg_init"), str(tmp), case)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.multiproc
def test_divergent_units_raise_on_both_ranks(tmp_path: Path) -> None:
    """Per-expert units with the MoE block not kept whole: rank 0 gathers expert 0 while
    rank 1 gathers expert 2 (same size: without the check they would exchange each
    other's experts). Both ranks raise, naming both units, well within the timeout."""
    results = _run_diverge(tmp_path, "experts")
    for rank, res in enumerate(results):
        err = res["error"]
        assert err is not None, rank
        assert "ranks diverged" in err
        assert "'layers.0.experts.0/float32/trainable'" in err
        assert "'layers.0.experts.2/float32/trainable'" in err
        assert "zero.leaf_modules" in err  # the fix
        assert res["seconds"] < DIVERGE_TIMEOUT_S


@pytest.mark.multiproc
def test_collective_nobody_joins_times_out(tmp_path: Path) -> None:
    """A gather whose peer never comes raises after zero.collective_timeout_s, naming it."""
    r0, r1 = _run_diverge(tmp_path, "timeout")
    assert r1["error"] is None
    assert r0["error"] is not None and "collective_timeout_s = 2 s" in r0["error"]
    assert "blocks.7/float32/trainable" in r0["error"]
    assert 2.0 <= r0["seconds"] < 6.0
