"""offload.optimizer.master_precision bf16 in the engine ([Note: bf16 master weights] in
offload/bf16_master.py): the compute copy is the master.

The reference is plain PyTorch: the model in bf16, each step torch.optim.AdamW (single
tensor) on an fp32 upcast of each flat group's bf16 parameters, gradients clipped as
torch's clip_grad_norm_ does (fp32 norm per group, squares summed in fp64), the result
rounded to bf16 stochastically with the same counter-based bits (the engine's group key,
rank and element index), the moments kept as the engine keeps them (fp32, or int8 bytes
through state_codec, the same pieces). The engine's kernel follows torch's operation order
but may differ by an fp32 ulp in rare elements ([Note: Adam operation order]); the
stochastic rounding turns that into a bf16 ulp on about one element in 2^16, so the
comparison is: the losses equal to 1e-3; with fp32 moments nearly every parameter element
bit for bit and the rest within two bf16 ulps (measured on the machine this was written on:
every element bit for bit); with int8 moments, where such an ulp can move a code and the
runs part, the bound of assert_int8_trajectory. Bit-exact (torch.equal): the in-place and
streamed steps, and a resume from a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import full_params, make_batches, make_config, make_model, train_steps

from tierzero import engine
from tierzero.engine.config import (
    BudgetsConfig,
    Config,
    ConfigError,
    OffloadConfig,
    OptimizerOffloadConfig,
    ParamOffloadConfig,
)
from tierzero.engine.config.load import load_config
from tierzero.engine.cpu_matmul import LowPrecisionMatmul, upcast_matmul
from tierzero.engine.hf import export_hf
from tierzero.offload import state_codec as sc
from tierzero.offload.bf16_master import master_key, shard_salt

STEPS = 5
CLIP = 1.45  # the gradient norm here is 1.40-1.58: clipping fires on steps 1, 2 and 4


def configure(offload: str, swap: Path | None, *, master: str = "bf16", state: str = "fp32",
              chunk: int | None = None, clip: float = CLIP, overlap: bool = True) -> Config:
    """make_config (lr 1e-2, AdamW (0.9, 0.95), wd 0.1) in bf16 with params and optimizer
    state on `offload`; a device tier below the params, so caches are evicted."""
    cfg = make_config("bf16", clip=clip)
    where = str(swap) if offload == "nvme" else None
    if swap is not None:
        swap.mkdir(parents=True, exist_ok=True)
    opt = OptimizerOffloadConfig(device=offload, path=where,  # type: ignore[arg-type]
                                 master_precision=master,  # type: ignore[arg-type]
                                 state_precision=state,  # type: ignore[arg-type]
                                 overlap_step=overlap)
    if chunk is not None:
        opt = replace(opt, chunk_numel=chunk)
    return replace(cfg, offload=OffloadConfig(
        params=ParamOffloadConfig(device=offload, path=where),  # type: ignore[arg-type]
        optimizer=opt, budgets=BudgetsConfig(device_bytes=64 << 10)))


def run(cfg: Config, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    model = make_model()
    eng, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        losses = train_steps(eng, make_batches(steps))
        return losses, full_params(eng, model), eng.memory_report()
    finally:
        eng.close()


def plain_sr(x: torch.Tensor, key: int, offset: int = 0) -> torch.Tensor:
    """Stochastic rounding in plain PyTorch ops: 16 random bits added below the bf16
    mantissa, the low half truncated."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    top = ((bits + (sc.random_bits(x.numel(), key, offset) & 0xFFFF)) >> 16) & 0xFFFF
    return top.to(torch.int32).to(torch.int16).view(torch.bfloat16)


class Reference:
    """Plain PyTorch bf16 training with fp32 AdamW and stochastic rounding (module doc)."""

    def __init__(self, model: torch.nn.Module, groups: list[tuple[str, int, list[Any]]],
                 cfg: Config) -> None:
        self.model = copy.deepcopy(model).bfloat16()
        params = dict(self.model.named_parameters())
        # per flat group: (key, shard numel, [(param, offset)]), a flat fp32 working copy
        self.groups = [(key, n, [(params[q], off) for q, off in slots])
                       for key, n, slots in groups]
        o, opt = cfg.optimizer, cfg.offload.optimizer
        self.work = [torch.zeros(n, requires_grad=True) for _, n, _ in self.groups]
        self.opt = torch.optim.AdamW(self.work, lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay, foreach=False)
        self.state = opt.state_precision
        piece = opt.chunk_numel if opt.device == "nvme" else None
        self.layouts = [sc.StoredLayout.of(self.state, n, piece) for _, n, _ in self.groups]
        self.stored: list[dict[str, torch.Tensor]] = [
            {k: torch.zeros(lay.stored_numel, dtype=lay.dtype)
             for k in ("exp_avg", "exp_avg_sq")} for lay in self.layouts]
        self.clip = cfg.gradient_clipping
        self.coefs: list[float] = []
        # the matrix products as the engine computes them on this CPU ([Note: low-precision
        # matmul on CPU]): the same gradients, so int8 moments, whose block scale one ulp
        # of one element can move, encode alike
        upcast = upcast_matmul(cfg.precision.cpu_matmul, torch.device("cpu"), torch.bfloat16)
        self.products = (functools.partial(LowPrecisionMatmul, torch.bfloat16) if upcast
                         else contextlib.nullcontext)

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        losses = []
        for step, (ids, tg) in enumerate(batches, start=1):
            with self.products():
                loss = self.model(ids, tg)
                loss.backward()
            losses.append(float(loss.detach()))
            self.step(step)
            self.model.zero_grad()
        return losses

    def step(self, step: int) -> None:
        grads = []
        for _, n, slots in self.groups:
            g = torch.zeros(n)
            for p, off in slots:
                g[off:off + p.numel()] = p.grad.float().flatten()  # type: ignore[union-attr]
            grads.append(g)
        total = 0.0
        for g in grads:  # fp32 norm per group, squares summed in fp64 (engine order)
            total += float(torch.linalg.vector_norm(g).double()) ** 2
        coef = min(1.0, self.clip / (math.sqrt(total) + 1e-6)) if self.clip else 1.0
        self.coefs.append(coef)
        for i, (key, n, slots) in enumerate(self.groups):
            w = self.work[i]
            with torch.no_grad():
                for p, off in slots:
                    w[off:off + p.numel()] = p.float().flatten()
            w.grad = grads[i] * coef
            st = self.opt.state[w]
            for k in ("exp_avg", "exp_avg_sq"):  # the moments as stored, decoded
                st[k] = torch.empty(n)
                self.layouts[i].decode(k, self.stored[i][k], st[k])
            st["step"] = torch.tensor(float(step - 1))
            self.opt.step()
            for k in ("exp_avg", "exp_avg_sq"):
                self.layouts[i].encode(k, st[k], self.stored[i][k], seed=sc.step_seed(step))
            new = plain_sr(w.detach(), master_key(step, shard_salt(f"{key}@rank0")))
            with torch.no_grad():
                for p, off in slots:
                    p.copy_(new[off:off + p.numel()].view(p.shape))

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float() for k, v in self.model.named_parameters()}


def engine_groups(cfg: Config) -> list[tuple[str, int, list[Any]]]:
    """Each trainable flat group's key, shard size and (parameter name, offset)s."""
    eng, _, _, _ = engine.initialize(model=make_model(), config=cfg, device="cpu")
    try:
        return [(g.key, g.shard_numel, [(s.qname, s.offset) for s in g.slots])
                for u in eng.units for g in u.groups if g.trainable]
    finally:
        eng.close()


def assert_near_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    a = torch.cat([got[k].flatten() for k in want])
    b = torch.cat([want[k].flatten() for k in want])
    same = a == b
    assert float(same.float().mean()) > 0.999, float(same.float().mean())
    ulp = torch.maximum(b.abs(), torch.full_like(b, 1e-30)) * 2.0 ** -7
    assert bool(((a - b).abs() <= 2 * ulp).all())


def assert_int8_trajectory(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                           start: torch.nn.Module, *, lr: float) -> None:
    """int8 moments: the fp32 ulp by which the kernel and torch's AdamW may differ
    ([Note: Adam operation order]; where, depends on how torch splits its loops, which
    follows its thread count) can move an int8 code, or a block's scale and with it the
    block's codes, and then a bf16 parameter and the next steps' gradients: the runs part
    after a few steps (measured with one intra-op thread: 88 % of the elements bit for bit
    after 5 steps, the mean difference 0.14 % of the mean change training made). Bounded:
    the mean difference within 1 % of the mean change, none over two steps of lr."""
    assert got.keys() == want.keys()
    a = torch.cat([got[k].flatten() for k in want])
    b = torch.cat([want[k].flatten() for k in want])
    s = torch.cat([p.detach().bfloat16().float().flatten() for _, p in start.named_parameters()])
    moved = float((b - s).abs().mean())
    assert float((a - b).abs().mean()) <= 0.01 * moved, (float((a - b).abs().mean()), moved)
    assert float((a - b).abs().max()) <= 2 * lr


@pytest.mark.parametrize(("offload", "state", "chunk"), [
    ("cpu", "fp32", None), ("nvme", "fp32", None), ("cpu", "int8", None),
    ("nvme", "int8", 1024)])
def test_training_matches_the_plain_pytorch_reference(tmp_path: Path, offload: str,
                                                      state: str, chunk: int | None) -> None:
    cfg = configure(offload, tmp_path / "swap", state=state, chunk=chunk)
    ref = Reference(make_model(), engine_groups(cfg), cfg)
    ref_losses = ref.train(make_batches(STEPS))
    assert min(ref.coefs) < 1.0 == max(ref.coefs)  # clipping fired on some steps only
    losses, params, report = run(cfg)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-3,
                               atol=0.0)
    if state == "fp32":
        assert_near_bitwise(params, ref.params())
    else:
        assert_int8_trajectory(params, ref.params(), make_model(), lr=cfg.optimizer.lr)
    # no fp32 master anywhere
    tiers = report["tiers"]
    assert all(by.get("master", 0) == 0 for by in tiers["homes"].values())
    assert all(c.get("master", 0) == 0 for c in tiers["moved_by_class"].values())
    start = {k: v.detach().bfloat16().float() for k, v in make_model().named_parameters()}
    assert max(float((params[k] - start[k]).abs().max()) for k in start) > 1e-2  # trained


def test_in_place_streamed_and_pieces_train_bitwise_alike(tmp_path: Path) -> None:
    """Host memory (in place, also without overlap), NVMe in one piece and in pieces of 333
    elements, parameters on the device: the same bits; a run with the fp32 master differs
    (it rounds to nearest)."""
    runs = {name: run(configure(off, tmp_path / name, chunk=chunk, overlap=ov))[1]
            for name, off, chunk, ov in (("cpu", "cpu", None, True),
                                         ("cpu_after", "cpu", None, False),
                                         ("nvme", "nvme", None, True),
                                         ("pieces", "nvme", 333, True))}
    # parameters homed on the device (ZeRO-Offload: updated through a host copy), at
    # stage 3 and at stage 2 (parameters not partitioned)
    for name, stage, off in (("params_device", 3, "nvme"), ("stage2", 2, "cpu")):
        cfg = configure(off, tmp_path / name)
        cfg = replace(cfg, zero=replace(cfg.zero, stage=stage), offload=replace(
            cfg.offload, params=ParamOffloadConfig(device="none")))
        runs[name] = run(cfg)[1]
    for name in ("cpu_after", "nvme", "pieces", "params_device", "stage2"):
        assert all(torch.equal(runs["cpu"][k], runs[name][k]) for k in runs["cpu"]), name
    fp32 = run(configure("cpu", tmp_path / "f", master="fp32"))[1]
    assert not all(torch.equal(runs["cpu"][k], fp32[k]) for k in fp32)


def test_nvme_moves_no_master_bytes(tmp_path: Path) -> None:
    """Per step the fp32 master's read and write (8 B/param) are gone and the param is
    written once, as before; the moments are unchanged."""
    moved = {}
    for master in ("fp32", "bf16"):
        _, _, report = run(configure("nvme", tmp_path / master, master=master), steps=3)
        moved[master] = report["tiers"]["moved_by_class"]
    to32, to16 = moved["fp32"]["host_to_nvme"], moved["bf16"]["host_to_nvme"]
    assert to32["master"] > 0 and to16.get("master", 0) == 0
    assert to16["exp_avg"] == to32["exp_avg"]
    assert to16["param"] == to32["param"]  # written once per step either way
    from32 = moved["fp32"]["nvme_to_host"]
    from16 = moved["bf16"]["nvme_to_host"]
    assert from32["master"] > 0 and from16.get("master", 0) == 0


def _trained(cfg: Config, start: int, stop: int, eng: Any) -> None:
    for ids, tg in make_batches(stop)[start:stop]:
        eng.backward(eng(ids, tg))
        eng.step()


@pytest.mark.parametrize(("offload", "state"), [("cpu", "fp32"), ("nvme", "int8")])
def test_resume_is_bit_exact(tmp_path: Path, offload: str, state: str) -> None:
    cfg = configure(offload, tmp_path / "a", state=state)
    model = make_model()
    a, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        _trained(cfg, 0, 3, a)
        a.save_checkpoint(tmp_path / "ck", tag="t")
        _trained(cfg, 3, 6, a)
        want = full_params(a, model)
    finally:
        a.close()
    manifest = (tmp_path / "ck" / "t" / "manifest.json").read_text()
    assert '"master"' not in manifest.split('"config"')[0]  # the groups save param instead
    model_b = make_model(seed=5)  # other initial weights: all come from the checkpoint
    b, _, _, _ = engine.initialize(model=model_b, config=configure(
        offload, tmp_path / "b", state=state), device="cpu")
    try:
        b.load_checkpoint(tmp_path / "ck", tag="t")
        _trained(cfg, 3, 6, b)
        got = full_params(b, model_b)
    finally:
        b.close()
    assert all(torch.equal(want[k], got[k]) for k in want)
    # consolidation: the trained groups' fp32 values are their bf16 masters, exactly
    state_dict = engine.consolidate(tmp_path / "ck", tag="t")
    assert all(v.dtype == torch.float32 for v in state_dict.values())
    assert all(torch.equal(v, v.bfloat16().float()) for v in state_dict.values())


def test_checkpoints_load_across_master_precisions(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """fp32 master -> bf16 run: rounded to nearest (the saving run's compute copy, bit for
    bit); bf16 master -> fp32 run: upcast exactly. Logged once each; both train on."""
    cfg32 = configure("cpu", None, master="fp32")
    model = make_model()
    a, _, _, _ = engine.initialize(model=model, config=cfg32, device="cpu")
    try:
        _trained(cfg32, 0, 3, a)
        a.save_checkpoint(tmp_path / "ck", tag="fp32")
        compute32 = full_params(a, model)  # the bf16 compute copy of the fp32 master
    finally:
        a.close()
    cfg16 = configure("nvme", tmp_path / "s16")
    model_b = make_model()
    b, _, _, _ = engine.initialize(model=model_b, config=cfg16, device="cpu")
    try:
        with caplog.at_level(logging.WARNING):
            b.load_checkpoint(tmp_path / "ck", tag="fp32")
        assert "saved with fp32 master weights, this run keeps bf16" in caplog.text
        assert all(torch.equal(compute32[k], v) for k, v in full_params(b, model_b).items())
        _trained(cfg16, 3, 5, b)
        b.save_checkpoint(tmp_path / "ck", tag="bf16")
        after16 = full_params(b, model_b)
    finally:
        b.close()
    caplog.clear()
    model_c = make_model()
    c, _, _, _ = engine.initialize(model=model_c, config=cfg32, device="cpu")
    try:
        with caplog.at_level(logging.WARNING):
            c.load_checkpoint(tmp_path / "ck", tag="bf16")
        assert "saved with bf16 master weights, this run keeps fp32" in caplog.text
        assert all(torch.equal(after16[k], v) for k, v in full_params(c, model_c).items())
        for key in c.store.group_keys():
            if c.store.has(key, "master"):
                with c.store.use(key, "master") as m, c.store.use(key, "param") as p:
                    assert torch.equal(m, p.float())
        _trained(cfg32, 5, 6, c)
    finally:
        c.close()


def test_config_refuses_where_it_does_not_apply(tmp_path: Path) -> None:
    base = {"zero": {"stage": 3}, "offload": {"optimizer": {"device": "cpu",
                                                           "master_precision": "bf16"}}}
    for dtype in ("fp16", "fp32"):
        with pytest.raises(ConfigError, match=r"offload\.optimizer\.master_precision.*"
                                              rf"precision\.dtype bf16 .* {dtype!r}.*allowed"):
            load_config({**base, "precision": dtype})
    with pytest.raises(ConfigError, match=r"offload\.optimizer\.master_precision.*'none'"):
        load_config({"zero": {"stage": 3}, "precision": "bf16", "offload": {"optimizer": {
            "device": "none", "master_precision": "bf16"}}})
    with pytest.raises(ConfigError, match=r"offload\.optimizer\.master_precision"):
        load_config({**base, "precision": "bf16", "offload": {"optimizer": {
            "device": "cpu", "master_precision": "fp16"}}})
    cfg = load_config({**base, "precision": "bf16"})
    assert cfg.offload.optimizer.master_precision == "bf16"
    assert load_config({"zero": {"stage": 3}}).offload.optimizer.master_precision == "fp32"


def test_load_pretrained_and_export_hf(tmp_path: Path) -> None:
    """load_pretrained writes the bf16 master (the file's values rounded to nearest); after
    training, export_hf writes it exactly (fp32 output of bf16 values)."""
    transformers = pytest.importorskip("transformers")
    from hf_helpers import VOCAB, save_tiny_llama
    from safetensors import safe_open

    base = save_tiny_llama(tmp_path / "base")
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(base))
    (tmp_path / "swap").mkdir()
    cfg = load_config({"precision": "bf16", "optimizer": {"lr": 1e-2},
                       "offload": {"device": "nvme", "path": str(tmp_path / "swap"),
                                   "optimizer": {"master_precision": "bf16"}}})
    eng, *_ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        engine.load_pretrained(eng, base)
        with safe_open(str(base / "model.safetensors"), framework="pt") as h:
            weights = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
        with engine.GatheredParameters(list(model.parameters())):
            loaded = {k: v.detach().clone() for k, v in model.named_parameters()}
        for k, v in weights.items():
            assert torch.equal(loaded[k], v.bfloat16()), k
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, VOCAB, (2, 12), generator=gen)
            eng.backward(eng(input_ids=x, labels=x).loss)
            eng.step()
        out = export_hf(eng, tmp_path / "out")
        with engine.GatheredParameters(list(model.parameters())):
            trained = {k: v.detach().float().clone() for k, v in model.named_parameters()}
    finally:
        eng.close()
    with safe_open(str(out / "model.safetensors"), framework="pt") as h:
        exported = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    assert exported.keys() == weights.keys()
    for k, v in exported.items():
        assert v.dtype == torch.float32 and torch.equal(v, trained[k]), k
    assert any(not torch.equal(trained[k], loaded[k].float()) for k in trained)


def _two_rank_resume(rank: int, tmp: str) -> tuple[bool, dict[str, torch.Tensor], list[int]]:
    """Two ranks, state in host memory: each rank rounds its own shards with its own bits
    (the salts differ), and a resume at world size 2 is bit-exact."""
    cfg = configure("cpu", None)
    batches = make_batches(4, seed=1 + rank)
    model = make_model()
    a, _, _, _ = engine.initialize(model=model, config=cfg, device="cpu")
    try:
        salts = [a.store.layout.master_salt(k) for k in a.store.group_keys()]
        for ids, tg in batches[:2]:
            a.backward(a(ids, tg))
            a.step()
        a.save_checkpoint(Path(tmp) / "ck", tag="t")
        for ids, tg in batches[2:]:
            a.backward(a(ids, tg))
            a.step()
        want = full_params(a, model)
    finally:
        a.close()
    model_b = make_model(seed=5)
    b, _, _, _ = engine.initialize(model=model_b, config=cfg, device="cpu")
    try:
        b.load_checkpoint(Path(tmp) / "ck", tag="t")
        for ids, tg in batches[2:]:
            b.backward(b(ids, tg))
            b.step()
        got = full_params(b, model_b)
    finally:
        b.close()
    return all(torch.equal(want[k], got[k]) for k in want), want, salts


@pytest.mark.multiproc
def test_two_ranks_resume_bit_exactly(tmp_path: Path) -> None:
    import functools

    from engine_dist import run_two_ranks

    results = run_two_ranks(tmp_path, {"run": functools.partial(_two_rank_resume,
                                                                tmp=str(tmp_path))})
    (ok0, want0, salts0), (ok1, want1, salts1) = (r["run"] for r in results)
    assert ok0 and ok1
    assert all(torch.equal(want0[k], want1[k]) for k in want0)  # one model on both ranks
    assert not set(salts0) & set(salts1)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_background_save_resumes_exactly(tmp_path: Path, offload: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A background save right after step 3 (its writer held until steps 4-6 changed every
    shard; with offload cpu and clipping the step's update is deferred into the next
    forward and held there until the save call returned, so the param parts are awaited):
    a run resumed from it ends where the uninterrupted run did, bit for bit."""
    import ckpt_bg_helpers as helpers

    real = helpers.bg_config

    def bf16_master(*args: Any, **kw: Any) -> Config:
        cfg = real(*args, **kw)
        return replace(cfg, offload=replace(cfg.offload, optimizer=replace(
            cfg.offload.optimizer, master_precision="bf16")))

    monkeypatch.setattr(helpers, "bg_config", bf16_master)
    kw: dict[str, Any] = {"offload": offload, "ckpt": str(tmp_path / "bg"), "n": 3, "m": 3}
    bg = helpers.bg_run(0, swap=str(tmp_path / "s1"), background=True, gate=True,
                        hold=offload == "cpu", **kw)
    assert bg["fallback"] is None
    if offload == "cpu":
        assert bg["held_pending"]  # the save returned while the held update was pending
    resumed = helpers.bg_run(0, swap=str(tmp_path / "s2"), background=False, load=True, **kw)
    bad = [k for k in bg["params"] if not torch.equal(bg["params"][k], resumed["params"][k])]
    assert not bad, bad
