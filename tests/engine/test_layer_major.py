"""Layer-major micro-batching ([Note: layer-major schedule] in engine/layer_major.py).

Tolerances: with one rank each untied parameter's gradient is summed in fp32 in the same
order as k micro-steps, so layer_major and micro_step end bit-identical (asserted with
torch.equal); with two ranks the sum is reduced once instead of per micro-batch, and a
tied weight's two uses are summed in fp32 instead of the compute dtype: fp32 summation
order only, asserted with the parity suite's fp32 bounds (PARAM_ATOL 1e-5 after AdamW
steps at lr 1e-2; loss rtol 1e-6). Against plain PyTorch the parity suite's bounds hold.
"""

from __future__ import annotations

import copy
import logging
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import (
    LOSS_RTOL,
    PARAM_ATOL,
    TinyLM,
    full_params,
    make_batches,
    make_model,
    reference_train,
)
from torch import nn

from tierzero import engine
from tierzero.engine import layer_major
from tierzero.engine.config import Config
from tierzero.engine.layer_major import _leaves_reached, train_schedule
from tierzero.offload.step_seam import TrainingStateError

GAS = 4
LR = 1e-2
STEPS = 2


def _config(tmp: Path, *, schedule: str, precision: str = "fp32", offload: str = "none",
            clip: float = 0.0, gas: int = GAS, units: list[str] | None = None,
            extra: dict[str, Any] | None = None) -> Config:
    raw: dict[str, Any] = {
        "zero": {"stage": 3, "persistence_threshold_bytes": 0,
                 "units": units if units is not None else ["Block"],
                 "collective_timeout_s": 60},
        "precision": precision,
        "batch": {"gradient_accumulation_steps": gas, "schedule": schedule},
        "optimizer": {"type": "adamw", "lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                      "weight_decay": 0.1},
        "gradient_clipping": clip,
        **(extra or {}),
    }
    if offload != "none":
        tmp.mkdir(parents=True, exist_ok=True)
        where = {"device": offload, **({"path": str(tmp)} if offload == "nvme" else {})}
        raw["offload"] = {"params": where, "optimizer": where}
    return engine.load_config(raw)


def _train(model: nn.Module, cfg: Config, batches: list[Any], *, steps: int = STEPS,
           loss_fn: Any = None, device: str = "cpu") -> dict[str, Any]:
    """train_batch over `steps` steps on `device`; losses, parameters and gathers per step."""
    eng, _, _, _ = engine.initialize(device=device, model=model, config=cfg)
    gas = cfg.batch.gradient_accumulation_steps or 1
    fn = loss_fn or (lambda mb: eng(*mb))
    losses: list[float] = []
    gathers: list[int] = []
    for s in range(steps):
        before = eng.scheduler.gathers
        out = eng.train_batch(batches[s * gas:(s + 1) * gas], lambda mb: fn_call(fn, eng, mb))
        gathers.append(eng.scheduler.gathers - before)
        losses += [float(x) for x in out]
    result = {"losses": losses, "params": full_params(eng, model), "gathers": gathers,
              "grad_norm": eng.get_global_grad_norm(),
              "schedule": eng.schedule, "report": eng.memory_report(),
              "skipped": eng.skipped_steps}
    eng.close()
    return result


def fn_call(fn: Any, eng: Any, mb: Any) -> torch.Tensor:
    return fn(mb) if fn.__code__.co_argcount == 1 else fn(eng, mb)  # type: ignore[no-any-return]


def bound_key_bias(a: dict[str, Any], b: dict[str, Any]) -> None:
    """GPT-2's key bias (the middle third of each c_attn.bias) has a zero gradient in exact
    arithmetic (softmax is shift-invariant across a row's keys): its gradient is fp32
    rounding noise, which Adam's m / sqrt(v) turns into steps of about lr of either sign,
    so a summation order alone can move it by up to 2 lr a step (1.1e-5 measured with one
    intra-op thread, over PARAM_ATOL). Compared within that bound, then set equal in `a`
    for _assert_same to compare the rest."""
    for k in [k for k in b["params"] if k.endswith("attn.c_attn.bias")]:
        x, y = a["params"][k].view(3, -1), b["params"][k].view(3, -1)
        assert float((x[1] - y[1]).abs().max()) <= 2 * LR * STEPS, k
        x[1] = y[1]


def _assert_same(a: dict[str, Any], b: dict[str, Any], *, exact: bool) -> None:
    assert len(a["losses"]) == len(b["losses"])
    for k, v in a["params"].items():
        if exact:
            assert torch.equal(v, b["params"][k]), k
        else:
            torch.testing.assert_close(v, b["params"][k], atol=PARAM_ATOL, rtol=0, msg=k)
    if exact:
        assert a["losses"] == b["losses"]
    else:
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]),
                                   rtol=LOSS_RTOL, atol=0)


# -- one rank: the test model, every offload config and precision --------------------------

@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("precision,clip", [("fp32", 0.0), ("bf16", 0.5), ("fp16", 0.5)])
def test_layer_major_equals_micro_step_bit_for_bit(tmp_path: Path, offload: str,
                                                   precision: str, clip: float) -> None:
    batches = make_batches(STEPS * GAS)
    runs = {s: _train(make_model(), _config(tmp_path / s, schedule=s, precision=precision,
                                            offload=offload, clip=clip), batches)
            for s in ("micro_step", "layer_major")}
    lm, ms = runs["layer_major"], runs["micro_step"]
    assert lm["schedule"] == "layer_major"  # no fallback
    _assert_same(lm, ms, exact=True)
    assert lm["grad_norm"] == ms["grad_norm"] and lm["grad_norm"] > 0  # clipping on or off
    # every unit gathered once per pass: a layer-major step of GAS micro-batches gathers
    # what one micro-step gathers (root, each block forward, each block backward but the
    # one kept gathered)
    assert lm["gathers"][1] * GAS == ms["gathers"][1]
    assert lm["gathers"][1] <= 1 + 2 * 4
    assert lm["report"]["layer_major_accum_peak_bytes"] > 0


def test_layer_major_matches_plain_pytorch(tmp_path: Path) -> None:
    batches = make_batches(STEPS * GAS)
    cfg = _config(tmp_path, schedule="layer_major", offload="nvme", clip=0.5)
    got = _train(make_model(), cfg, batches)
    ref = reference_train(make_model(), cfg, [batches], STEPS)
    for k, v in ref.params.items():
        torch.testing.assert_close(got["params"][k], v, atol=PARAM_ATOL, rtol=0, msg=k)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses),
                               rtol=LOSS_RTOL, atol=0)


@pytest.mark.cuda
def test_cuda_layer_major_matches_micro_step(tmp_path: Path) -> None:
    """Layer-major micro-batching on the GPU (4 micro-batches, state on NVMe, clipping):
    the micro-step schedule's parameters with a quarter of its gathers."""
    batches = make_batches(STEPS * GAS)
    runs = {s: _train(make_model(), _config(tmp_path / s, schedule=s, offload="nvme", clip=0.5),
                      batches, device="cuda")
            for s in ("micro_step", "layer_major")}
    lm, ms = runs["layer_major"], runs["micro_step"]
    assert (ms["schedule"], lm["schedule"]) == ("micro_step", "layer_major")  # no fallback
    assert lm["gathers"][1] * GAS == ms["gathers"][1]
    torch.testing.assert_close(torch.tensor(lm["losses"]), torch.tensor(ms["losses"]),
                               rtol=1e-5, atol=0)
    for k, want in ms["params"].items():
        torch.testing.assert_close(lm["params"][k], want, rtol=0, atol=1e-4, msg=k)


def test_fp16_overflow_skips_the_step_as_micro_step_does(tmp_path: Path) -> None:
    """A loss scale so large that the first step overflows: both schedules skip it (and
    lower the scale) and then train identically."""
    extra = {"precision": {"dtype": "fp16", "loss_scale": {"initial_scale_power": 60}}}
    batches = make_batches(3 * GAS)
    runs = {s: _train(make_model(), _config(tmp_path / s, schedule=s, offload="nvme",
                                            extra=extra), batches, steps=3)
            for s in ("micro_step", "layer_major")}
    assert runs["layer_major"]["skipped"] == runs["micro_step"]["skipped"] >= 1
    _assert_same(runs["layer_major"], runs["micro_step"], exact=True)


def test_frozen_params_and_unused_units(tmp_path: Path) -> None:
    """Frozen blocks (LoRA's base) get no gradient; a block no micro-batch runs still has
    its (zero) gradient reduced; results equal micro_step."""
    def model() -> TinyLM:
        m = make_model()
        for p in m.blocks[1].parameters():
            p.requires_grad_(False)
        return m

    batches = make_batches(STEPS * GAS)
    order = (0, 1, 3)  # block 2 never runs

    runs = {s: _train(model(), _config(tmp_path / s, schedule=s, offload="cpu"), batches,
                      loss_fn=lambda eng, mb: eng(*mb, order=order))
            for s in ("micro_step", "layer_major")}
    assert runs["layer_major"]["schedule"] == "layer_major"
    _assert_same(runs["layer_major"], runs["micro_step"], exact=True)


# -- fallbacks -------------------------------------------------------------------------------

class LeakyBlockLM(TinyLM):
    """Block 1 keeps a tensor of its forward on the side, and the loss reads it: its
    gradient could not reach the block if the block's graph were cut."""

    def forward(self, ids: torch.Tensor, targets: torch.Tensor,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
        leaked: list[torch.Tensor] = []
        handle = self.blocks[1].up.register_forward_hook(lambda m, a, out: leaked.append(out))
        try:
            loss = super().forward(ids, targets, order)
        finally:
            handle.remove()
        return loss + 1e-3 * leaked[0].float().pow(2).mean()


def _leaky() -> LeakyBlockLM:
    m = LeakyBlockLM()
    m.load_state_dict(make_model().state_dict())
    return m


def _reentrant() -> TinyLM:
    m = make_model()
    m.checkpointed = True
    return m


def _reentrant_call(eng: Any, mb: Any) -> torch.Tensor:
    return eng(*mb)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", ["leak", "reentrant", "order"])
def test_falls_back_to_micro_step_with_the_reason(tmp_path: Path, case: str,
                                                  caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    batches = make_batches(STEPS * GAS)
    build: Any = {"leak": _leaky, "reentrant": _reentrant, "order": make_model}[case]
    if case == "reentrant":  # HF's gradient_checkpointing_enable() default
        import engine_helpers

        real = engine_helpers.checkpoint
        monkeypatch.setattr(engine_helpers, "checkpoint",
                            lambda f, x, use_reentrant: real(f, x, use_reentrant=True))
    calls = {"n": 0}

    def loss_fn(eng: Any, mb: Any) -> torch.Tensor:
        calls["n"] += 1
        order = (0, 1, 2, 3) if calls["n"] % 2 else (0, 2, 1, 3)
        return eng(*mb, order=order if case == "order" else None)  # type: ignore[no-any-return]

    runs = {}
    for s in ("micro_step", "layer_major"):
        calls["n"] = 0
        with caplog.at_level(logging.WARNING, logger="tierzero.engine.engine"):
            runs[s] = _train(build(), _config(tmp_path / s, schedule=s), batches,
                             loss_fn=loss_fn)
    assert runs["layer_major"]["schedule"] == "micro_step"
    reason = {"leak": "alive after it returned", "reentrant": "gradients off",
              "order": "unit order differs"}[case]
    lines = [r.getMessage() for r in caplog.records if "layer_major" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0], lines
    if case != "order":  # the same micro-batches, so the same run as micro_step
        _assert_same(runs["layer_major"], runs["micro_step"], exact=True)


# -- the API ---------------------------------------------------------------------------------

def test_train_batch_checks_its_input(tmp_path: Path) -> None:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=_config(tmp_path, schedule="layer_major"))
    batches = make_batches(GAS)
    with pytest.raises(ValueError, match=r"3 micro-batches given.*= 4"):
        eng.train_batch(batches[:3], lambda mb: eng(*mb))
    loss = eng(*batches[0])
    eng.backward(loss)
    eng.step()
    with pytest.raises(TrainingStateError, match="1 micro-step"):
        eng.train_batch(batches, lambda mb: eng(*mb))
    eng.close()


def test_check_losses_stops_before_any_gradient_reaches_a_shard(tmp_path: Path) -> None:
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model,
                                     config=_config(tmp_path, schedule="layer_major",
                                                    offload="nvme"))
    before = full_params(eng, model)

    def refuse(losses: list[torch.Tensor]) -> None:
        assert len(losses) == GAS
        raise RuntimeError("not finite")

    with pytest.raises(RuntimeError, match="not finite"):
        eng.train_batch(make_batches(GAS), lambda mb: eng(*mb), check_losses=refuse)
    after = full_params(eng, model)
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
    eng.train_batch(make_batches(GAS), lambda mb: eng(*mb))  # the engine goes on
    assert eng.global_steps == 1
    eng.close()


def test_schedule_auto_rule(tmp_path: Path) -> None:
    def resolved(offload: str, gas: int) -> str:
        return train_schedule(_config(tmp_path, schedule="auto", offload=offload, gas=gas),
                              gas)

    assert resolved("nvme", 4) == "layer_major"
    assert resolved("cpu", 4) == "layer_major"
    assert resolved("nvme", 1) == "micro_step"
    assert resolved("none", 4) == "micro_step"
    with pytest.raises(engine.ConfigError, match=r"batch\.schedule"):
        _config(tmp_path, schedule="zigzag")


def test_resume_mid_run_is_exact(tmp_path: Path) -> None:
    batches = make_batches(3 * GAS)
    cfg = _config(tmp_path / "swap", schedule="layer_major", offload="nvme", clip=0.5)
    straight = _train(make_model(), cfg, batches, steps=3)

    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    for s in range(2):
        eng.train_batch(batches[s * GAS:(s + 1) * GAS], lambda mb: eng(*mb))
    eng.save_checkpoint(tmp_path / "ckpt")
    eng.close()
    model = make_model(seed=5)
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    eng.load_checkpoint(tmp_path / "ckpt")
    last = eng.train_batch(batches[2 * GAS:], lambda mb: eng(*mb))
    params = full_params(eng, model)
    eng.close()
    assert [float(x) for x in last] == straight["losses"][2 * GAS:]
    for k, v in straight["params"].items():
        assert torch.equal(v, params[k]), k


# -- Hugging Face models ----------------------------------------------------------------------

def _hf(arch: str, *, lora: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, num_key_value_heads=2,
                                         **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2,
                                       tie_word_embeddings=arch == "llama_tied", **common)
        model = transformers.LlamaForCausalLM(cfg)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return model  # type: ignore[no-any-return]


def hf_batches(rank: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (2, 8), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def hf_run(rank: int, *, arch: str, schedule: str, offload: str, precision: str,
           clip: float, tmp: Path, lora: bool = False) -> dict[str, Any]:
    path = tmp / f"{arch}-{schedule}-{offload}-{precision}-r{rank}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(path, schedule=schedule, precision=precision, offload=offload, clip=clip,
                  units=[])
    return _train(_hf(arch, lora=lora), cfg, hf_batches(rank, STEPS * GAS),
                  loss_fn=lambda eng, mb: eng(**mb).loss)


HF_CASES = [("llama", "nvme", "bf16", 1.0), ("llama_tied", "cpu", "fp32", 0.0),
            ("gpt2", "nvme", "fp32", 1.0), ("mixtral", "cpu", "bf16", 1.0)]


@pytest.mark.parametrize("arch,offload,precision,clip", HF_CASES)
def test_hf_models_layer_major(tmp_path: Path, arch: str, offload: str, precision: str,
                               clip: float) -> None:
    runs = {s: hf_run(0, arch=arch, schedule=s, offload=offload, precision=precision,
                      clip=clip, tmp=tmp_path) for s in ("micro_step", "layer_major")}
    assert runs["layer_major"]["schedule"] == "layer_major"
    if arch == "gpt2":
        bound_key_bias(runs["layer_major"], runs["micro_step"])
    # tied embeddings (GPT-2's by default): the two uses are summed in fp32 (module doc)
    _assert_same(runs["layer_major"], runs["micro_step"], exact=arch not in ("llama_tied",
                                                                             "gpt2"))
    assert runs["layer_major"]["gathers"][1] * GAS == runs["micro_step"]["gathers"][1]


def test_hf_lora_layer_major(tmp_path: Path) -> None:
    runs = {s: hf_run(0, arch="llama", schedule=s, offload="nvme", precision="bf16",
                      clip=1.0, tmp=tmp_path, lora=True) for s in ("micro_step", "layer_major")}
    assert runs["layer_major"]["schedule"] == "layer_major"
    _assert_same(runs["layer_major"], runs["micro_step"], exact=True)


# -- two ranks ---------------------------------------------------------------------------------

def tiny_run(rank: int, *, schedule: str, offload: str, tmp: Path) -> dict[str, Any]:
    path = tmp / f"tiny-{schedule}-{offload}-r{rank}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(path, schedule=schedule, offload=offload, clip=0.5)
    return _train(make_model(), cfg, make_batches(STEPS * GAS, seed=1 + rank))


@pytest.mark.multiproc
def test_two_ranks_layer_major_matches_micro_step(tmp_path: Path) -> None:
    scenarios: dict[str, Any] = {}
    for s in ("micro_step", "layer_major"):
        for off in ("none", "nvme"):
            scenarios[f"tiny-{s}-{off}"] = partial(tiny_run, schedule=s, offload=off,
                                                   tmp=tmp_path)
        scenarios[f"mixtral-{s}"] = partial(hf_run, arch="mixtral", schedule=s,
                                            offload="cpu", precision="fp32", clip=1.0,
                                            tmp=tmp_path)
        scenarios[f"lora-{s}"] = partial(hf_run, arch="llama", schedule=s, offload="nvme",
                                         precision="fp32", clip=1.0, tmp=tmp_path, lora=True)
    results = run_two_ranks(tmp_path, scenarios)
    for name in ("tiny-{}-none", "tiny-{}-nvme", "mixtral-{}", "lora-{}"):
        lm, ms = (results[0][name.format(s)] for s in ("layer_major", "micro_step"))
        assert lm["schedule"] == "layer_major", name
        for r in (0, 1):  # every rank ends with the same model
            for k, v in lm["params"].items():
                assert torch.equal(v, results[r][name.format("layer_major")]["params"][k])
        _assert_same(lm, ms, exact=False)


def test_engine_reports_the_schedule_it_runs(tmp_path: Path) -> None:
    cfg = _config(tmp_path, schedule="auto", offload="nvme")
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=copy.deepcopy(cfg))
    assert eng.schedule == "layer_major"
    eng.close()


def test_init_build_and_the_trace_show_one_gather_per_unit_per_pass(tmp_path: Path) -> None:
    """A model built under tierzero.Init onto NVMe trains layer-major as the same model
    built whole does; the trace of a step holds each block's gather once in forward and
    at most once in backward (the last block may stay gathered), the root's once."""
    from tierzero.swap import trace

    cfg = _config(tmp_path / "swap", schedule="layer_major", offload="nvme", clip=0.5)
    batches = make_batches(STEPS * GAS)
    whole = _train(make_model(), cfg, batches)
    with engine.Init(config=cfg):
        model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    eng.train_batch(batches[:GAS], lambda mb: eng(*mb))
    rec = trace.Recorder(process="test")
    with trace.recording(rec):
        eng.train_batch(batches[GAS:2 * GAS], lambda mb: eng(*mb))
    params = full_params(eng, model)
    eng.close()
    for k, v in whole["params"].items():
        assert torch.equal(v, params[k]), k
    gathers: dict[str, int] = {}
    for e in rec.events:
        if e.get("cat") == "gather":
            gathers[e["name"]] = gathers.get(e["name"], 0) + 1
    blocks = [f"blocks.{i}" for i in range(4)]
    assert gathers.pop("<root>") == 1
    assert sorted(gathers) == blocks and all(1 <= n <= 2 for n in gathers.values())
    assert sum(gathers.values()) == 2 * 4 - 1  # the last block stays gathered for backward


def test_an_error_in_one_micro_batch_stops_the_pass_and_the_engine_goes_on(
        tmp_path: Path) -> None:
    """A loss_fn that raises on micro-batch 2 (a user error, not a fallback): the error
    reaches the caller after every micro-batch thread has ended, nothing reached a shard,
    and the next train_batch trains as a fresh engine would."""
    batches = make_batches(2 * GAS)
    cfg = _config(tmp_path / "swap", schedule="layer_major", offload="nvme")
    model = make_model()
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    calls = {"n": 0}

    def bad(mb: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyError("user bug")
        return eng(*mb)  # type: ignore[no-any-return]

    with pytest.raises(KeyError, match="user bug"):
        eng.train_batch(batches[:GAS], bad)
    assert eng.schedule == "layer_major" and eng.global_steps == 0
    eng.train_batch(batches[GAS:], lambda mb: eng(*mb))
    params = full_params(eng, model)
    eng.close()
    fresh = _train(make_model(), _config(tmp_path / "swap2", schedule="layer_major",
                                         offload="nvme"), batches[GAS:], steps=1)
    for k, v in fresh["params"].items():
        assert torch.equal(v, params[k]), k


class _Node:
    """A graph node whose Python object is made afresh on every `next_functions` access and
    freed when dropped, as autograd's node objects can be: a freed object's id is reused."""

    def __init__(self, children: list[Any], variable: torch.Tensor | None = None) -> None:
        self._children = children
        self.variable = variable

    @property
    def next_functions(self) -> tuple[tuple[_Node, int], ...]:
        return tuple((_Node(c._children, c.variable), 0) for c in self._children)


def test_leaves_reached_finds_every_leaf_when_node_objects_are_transient() -> None:
    """`_leaves_reached` (which root groups wait for backward) with node objects that die as
    the walk moves on: every leaf behind the output is found. A walk remembering visited
    ids alone skipped a new node carrying a freed node's id, and with it the embedding
    behind a unit: its gradient never reached the shard (the CUDA layer-major bug)."""
    params = [torch.zeros(1, requires_grad=True) for _ in range(6)]

    def chain(depth: int, leaf: torch.Tensor) -> _Node:
        node = _Node([], leaf)
        for _ in range(depth):
            node = _Node([node])
        return node

    root = _Node([chain(d + 1, p) for d, p in enumerate(params)])

    class Output:
        grad_fn = root

    got = _leaves_reached([Output()])  # type: ignore[list-item]
    assert got == {id(p) for p in params}


def test_a_gradient_after_its_group_was_reduced_abandons_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If a root group were reduced before backward although a unit's graph reaches one of
    its parameters (the walk missing it), that parameter's later gradient raises instead of
    being dropped in silence, and the step is abandoned: no parameter changes."""
    monkeypatch.setattr(layer_major, "_leaves_reached", lambda outputs: set())
    cfg = _config(tmp_path, schedule="layer_major")
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    eng, _, _, _ = engine.initialize(device="cpu", model=model, config=cfg)
    with pytest.raises(RuntimeError, match="after its group was reduced"):
        eng.train_batch(make_batches(GAS), lambda mb: eng(*mb))
    assert eng.global_steps == 0
    after = full_params(eng, model)
    eng.close()
    for k, v in after.items():
        assert torch.equal(v, before[k]), k
