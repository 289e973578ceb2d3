"""Unit discovery (config classes, _no_split_modules, size rule, tied weights) and the
engine's handling of frozen parameters, no-grad forwards and bad arguments."""

from __future__ import annotations

import copy
import dataclasses as dc
from collections import OrderedDict

import pytest
import torch
from engine_helpers import (
    Block,
    TinyLM,
    assert_match,
    make_batches,
    make_config,
    make_model,
)
from torch import nn

from tierzero import engine
from tierzero.engine.hooks import output_tensors
from tierzero.engine.units import discover_units


def _names(model: nn.Module, classes: list[str] | None, min_bytes: int = 1) -> list[str]:
    return [u.name for u in discover_units(model, classes, min_bytes)]


def test_units_from_config_classes_and_root_last() -> None:
    model = make_model()
    specs = discover_units(model, ["Block"], 1)
    assert [u.name for u in specs] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", ""]
    assert specs[-1].is_root
    root = {q for q, _ in specs[-1].params}
    assert root == {"emb.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    owned = [q for s in specs for q, _ in s.params]
    assert sorted(owned) == sorted(k for k, _ in model.named_parameters())  # each exactly once


def test_units_from_no_split_modules() -> None:
    model = make_model()
    model._no_split_modules = ["Block"]  # type: ignore[assignment]
    assert _names(model, None)[:4] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_size_rule_picks_smallest_modules_over_bound() -> None:
    model = make_model()
    linear_bytes = 4 * (64 * 32 + 32)  # Block.down holds 8320 bytes, Block.up 8448
    names = _names(model, None, min_bytes=linear_bytes)
    assert "blocks.0.up" in names and "blocks.0.down" in names and "blocks.0" not in names
    names = _names(model, None, min_bytes=2 * linear_bytes)  # only whole blocks qualify
    assert names[:4] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def test_weight_tied_across_units_goes_to_root() -> None:
    model = make_model()
    model.blocks[1].up.weight = model.blocks[0].up.weight
    specs = discover_units(model, ["Block"], 1)
    root = {q for q, _ in specs[-1].params}
    assert "blocks.0.up.weight" in root
    assert all("up.weight" not in q for s in specs[:2] for q, _ in s.params)


def test_unknown_unit_class_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="NoSuchBlock"):
        discover_units(make_model(), ["NoSuchBlock"], 1)


def test_frozen_parameters_are_not_trained() -> None:
    """model_parameters= picks what trains; the rest keeps its values, and the trained part
    matches plain PyTorch with the same parameters frozen."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    frozen = {"blocks.1.up.weight", "emb.weight"}
    train_params = [p for k, p in model.named_parameters() if k not in frozen]
    cfg = make_config(clip=0.5)
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg,
                                     model_parameters=train_params)
    for k, p in ref_model.named_parameters():
        p.requires_grad_(k not in frozen)
    o = cfg.optimizer
    opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=o.lr,
                            betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    losses, ref_losses = [], []
    for ids, tg in make_batches(6):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        losses.append(float(loss.detach()))
        ref_loss = ref_model(ids, tg)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(ref_loss.detach()))
    with engine.GatheredParameters(list(model.parameters())):
        got = {k: p.detach().clone() for k, p in model.named_parameters()}
    assert_match(losses, got, ref_losses,
                 {k: p.detach() for k, p in ref_model.named_parameters()})
    assert torch.equal(got["emb.weight"], make_model().emb.weight.detach())
    eng.close()


def test_no_grad_forward_releases_everything() -> None:
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config())
    ids, tg = make_batches(1)[0]
    with torch.no_grad():
        loss = eng.eval()(ids, tg)
    assert torch.isfinite(loss)
    assert all(p.numel() == 0 for p in model.parameters())
    assert eng.memory_report()["gathered_bytes"] == 0
    assert not model.training
    eng.close()


def test_initialize_rejects_bad_arguments() -> None:
    with pytest.raises(engine.ConfigError, match="stage"):
        engine.initialize(device="cpu", model=make_model(), config={"zero": {"stage": 7}})
    with pytest.raises(ValueError, match="lr_scheduler"):
        engine.initialize(device="cpu", model=make_model(), config=make_config(),
                          lr_scheduler=object())
    with pytest.raises(ValueError, match="not parameters of model"):
        engine.initialize(device="cpu", model=make_model(), config=make_config(),
                          model_parameters=[nn.Parameter(torch.zeros(2))])


def test_user_optimizer_is_rebuilt_over_master_shards() -> None:
    model = make_model()
    user_opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.8, 0.9))
    eng, opt, _, _ = engine.initialize(device="cpu", model=model, config=make_config(),
                                       optimizer=user_opt)
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["betas"] == (0.8, 0.9)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(eng.store.tensor(k, "master")) for k in eng._train_keys}
    eng.close()


def test_block_classes_used_by_tests_exist() -> None:
    assert isinstance(make_model(), TinyLM) and issubclass(Block, nn.Module)


def test_initialize_takes_native_and_deepspeed_config_mappings() -> None:
    native = {"zero": {"stage": 3, "units": ["Block"]}, "precision": "bf16",
              "optimizer": {"type": "adam", "lr": 1e-3},
              "batch": {"gradient_accumulation_steps": 2}}
    eng, opt, _, _ = engine.initialize(device="cpu", model=make_model(), config=native)
    assert eng.dtype == torch.bfloat16 and eng.grad_accum == 2
    assert type(opt) is torch.optim.Adam and len(eng.units) == 5
    eng.close()
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "fp16": {"enabled": True}, "gradient_clipping": 1.0,
          "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=ds)
    assert eng.dtype == torch.float16 and eng.loss_scaler is not None
    ids, tg = make_batches(1)[0]
    eng.backward(eng(ids, tg))
    eng.step()
    # offload_param cpu is acted on: param shards are homed in host memory
    tiers = eng.memory_report()["tiers"]
    assert tiers is not None and tiers["current"]["host"] > 0
    eng.close()


class WithOddParams(nn.Module):
    """A zero-size parameter and a non-contiguous (transposed) one in a block."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(n_blocks=2)
        self.inner.blocks[0].empty = nn.Parameter(torch.zeros(0))
        self.inner.blocks[1].up.weight = nn.Parameter(
            self.inner.blocks[1].up.weight.detach().t().contiguous().t())

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.inner(ids, targets) + self.inner.blocks[0].empty.sum()


def test_zero_size_and_non_contiguous_parameters_train() -> None:
    model = WithOddParams()
    assert not model.inner.blocks[1].up.weight.is_contiguous()
    want = {k: p.detach().clone() for k, p in model.named_parameters()}
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=make_config())
    with engine.GatheredParameters(list(model.parameters())):
        for k, p in model.named_parameters():
            assert torch.equal(p.detach(), want[k]), k
    for ids, tg in make_batches(2):
        loss = eng(ids, tg)
        eng.backward(loss)
        eng.step()
        assert torch.isfinite(loss)
    eng.close()


def test_output_tensors_found_in_nested_outputs() -> None:
    class Out(OrderedDict):  # like transformers' ModelOutput, unknown to pytree here
        pass

    @dc.dataclass
    class Pair:
        a: torch.Tensor
        b: int

    t1, t2, t3 = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    found = output_tensors((Out(x=t1, y=[t2, 3]), Pair(t3, 4), None))
    assert [id(t) for t in found] == [id(t1), id(t2), id(t3)]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)  # 272 params = 1088 bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _Wrapper(nn.Module):
    """A user module around an inner model, as people wrap HF models."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x)).sum()


def test_size_rule_never_picks_a_container() -> None:
    # Each layer (1088 B) is below the bound, the ModuleList (4352 B) above it: the
    # list has no forward of its own, so the unit must be the module that runs it.
    model = _Wrapper(_Stack())
    names = [u.name for u in discover_units(model, None, 2000) if not u.is_root]
    assert names == ["inner"]


def test_no_split_modules_found_on_a_wrapped_model() -> None:
    inner = _Stack()
    inner._no_split_modules = ["_Layer"]  # type: ignore[assignment]
    names = [u.name for u in discover_units(_Wrapper(inner), None, 1 << 30) if not u.is_root]
    assert names == [f"inner.layers.{i}" for i in range(4)]


def test_wrapped_model_trains_with_size_rule_units() -> None:
    torch.manual_seed(0)
    model = _Wrapper(_Stack())
    cfg = {"zero": {"stage": 3, "unit_min_bytes": 2000}, "optimizer": {"lr": 1e-2}}
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device=torch.device("cpu"))
    for _ in range(2):
        loss = eng(torch.randn(4, 16))
        eng.backward(loss)
        eng.step()
    eng.close()
