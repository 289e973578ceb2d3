"""The in-place CPU Adam step begun during backward ([Note: in-place early step]).

Exactness: handing a unit's groups to the worker thread changes when and on which thread
the kernel runs, not what it computes (an elementwise kernel): runs with
offload.optimizer.overlap_step on and off must give bit-identical losses and parameters,
and stay within the AdamW parity tolerances of plain PyTorch (engine_helpers.PARAM_ATOL,
LOSS_RTOL). Overlap is shown by slowing the worker down (an injected sleep), never by
timing.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_dist import run_two_ranks
from engine_helpers import (
    RefResult,
    TinyLM,
    assert_match,
    engine_train,
    in_place_of,
    make_batches,
    make_config,
    make_model,
    reference_train,
)

from tierzero import engine
from tierzero.engine.checkpoint.save import CheckpointError
from tierzero.engine.config import Config
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.in_place import InPlaceStep, threads_during_backward
from tierzero.engine.step.offloaded import OffloadedStep

REPO = Path(__file__).resolve().parents[3]


def cpu_config(*, overlap: bool, gas: int = 1, params: str = "cpu", precision: str = "fp32",
               clip: float = 0.0) -> Config:
    """Optimizer state (and params) homed in host memory: the in-place step."""
    return dataclasses.replace(
        make_config(precision=precision, gas=gas, clip=clip), offload=OffloadConfig(
            params=ParamOffloadConfig(device=params),  # type: ignore[arg-type]
            optimizer=OptimizerOffloadConfig(device="cpu", overlap_step=overlap)))


def in_place(eng: ZeroEngine) -> InPlaceStep:
    opt = eng.step_driver
    assert isinstance(opt, OffloadedStep) and in_place_of(opt) is not None
    return in_place_of(opt)


@pytest.mark.parametrize(("gas", "params", "precision"),
                         [(1, "cpu", "fp32"), (4, "cpu", "fp32"), (2, "none", "fp32"),
                          (1, "cpu", "bf16")])
def test_step_during_backward_is_bit_identical_and_matches_pytorch(
        gas: int, params: str, precision: str) -> None:
    steps = 5
    batches = make_batches(steps * gas)
    on = engine_train(cpu_config(overlap=True, gas=gas, params=params, precision=precision),
                      batches, steps)
    off = engine_train(cpu_config(overlap=False, gas=gas, params=params, precision=precision),
                       batches, steps)
    assert on.losses == off.losses
    assert on.params.keys() == off.params.keys()
    for k, v in off.params.items():
        assert torch.equal(on.params[k], v), k
    if precision == "fp32":
        ref = reference_train(make_model(), make_config(gas=gas), [batches], steps)
        assert_match(on.losses, on.params, ref.losses, ref.params)


def test_units_are_updated_on_the_worker_while_backward_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker is slowed (50 ms per group): backward returns with groups still queued,
    so they really ran beside it; every unit's groups ran on the worker thread, only the
    root (reduced at the very end of backward, also handed over) may finish in step()."""
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                       config=cpu_config(overlap=True))
    opt = eng.step_driver
    try:
        step = in_place(eng)
        threads: dict[str, str] = {}
        real = step.update

        def slow(key: str, *args: object) -> float:
            threads[key] = threading.current_thread().name
            time.sleep(0.05)
            return real(key, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(step, "update", slow)
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        assert isinstance(opt, OffloadedStep) and opt.step_open
        assert len(step._done) < len(eng._train_keys)  # the worker is still busy
        assert step._submitted == set(eng._train_keys)  # every unit was handed over
        eng.step()
        assert not opt.step_open and eng.global_steps == 1
        assert set(threads) == set(eng._train_keys)
        assert all(name.startswith("tierzero-adam-early") for name in threads.values())
    finally:
        eng.close()


def test_worker_failure_reaches_step_naming_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=cpu_config(overlap=True))
    try:
        step = in_place(eng)
        real = step.update
        bad = eng._train_keys[1]

        def fail(key: str, *args: object) -> float:
            if key == bad:
                raise OSError("injected kernel failure")
            return real(key, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(step, "update", fail)
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        with pytest.raises(RuntimeError, match=f"shard group '{bad}'.*injected kernel"):
            eng.step()
        assert not eng.step_driver.step_open
        monkeypatch.setattr(step, "update", real)
        eng.zero_grad()
        for ids, tg in make_batches(2):  # training goes on
            eng.backward(eng(ids, tg))
            eng.step()
    finally:
        eng.close()


def test_zero_grad_forward_and_checkpoints_wait_for_or_refuse_the_open_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(),
                                     config=cpu_config(overlap=True))
    try:
        step = in_place(eng)
        real = step.update

        def slow(key: str, *args: object) -> float:
            time.sleep(0.03)
            return real(key, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(step, "update", slow)
        ids, tg = make_batches(1)[0]
        eng.backward(eng(ids, tg))
        with pytest.raises(CheckpointError, match="between backward"):
            eng.save_checkpoint(tmp_path)
        with torch.no_grad():
            eng(ids, tg)  # a forward waits for the worker before it gathers anything
        assert all(job.done() for job in step._jobs)
        eng.step()
        eng.backward(eng(ids, tg))
        eng.zero_grad()  # waits too: the worker never reads a gradient being zeroed
        assert all(job.done() for job in step._jobs)
        eng.step()
    finally:
        eng.close()


def test_no_update_during_backward_with_clipping_or_fp16() -> None:
    for cfg in (cpu_config(overlap=True, clip=1.0), cpu_config(overlap=True,
                                                                precision="fp16")):
        eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
        opt = eng.step_driver
        try:
            ids, tg = make_batches(1)[0]
            eng.backward(eng(ids, tg))
            assert isinstance(opt, OffloadedStep) and not opt.step_open
            eng.step()
        finally:
            eng.close()


def test_kernel_threads_during_backward_leave_torch_its_cores() -> None:
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert threads_during_backward(2) == 1
        assert threads_during_backward(8) == 7
        assert threads_during_backward(1) == 1
        torch.set_num_threads(2)
        assert threads_during_backward(2) == 1  # never zero: oversubscribe by one at most
        assert threads_during_backward(16) == 14
    finally:
        torch.set_num_threads(old)


_EXIT_SCRIPT = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
import dataclasses, torch, engine
from engine_helpers import make_batches, make_model, make_config
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig, ParamOffloadConfig
torch.set_num_threads(1)
cfg = dataclasses.replace(make_config(), offload=OffloadConfig(
    params=ParamOffloadConfig(device="cpu"), optimizer=OptimizerOffloadConfig(device="cpu")))
eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
ids, tg = make_batches(1)[0]
eng.backward(eng(ids, tg))
if sys.argv[1] == "step":
    eng.step()
elif sys.argv[1] == "raise":
    raise SystemExit(3)
# "open": the interpreter exits with the step begun and the engine never closed
"""


@pytest.mark.parametrize(("how", "code"), [("step", 0), ("open", 0), ("raise", 3)])
def test_interpreter_exits_cleanly_with_the_worker(how: str, code: int) -> None:
    script = _EXIT_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests"))
    done = subprocess.run([sys.executable, "-c", script, how], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == code, done.stderr[-2000:]


def _ranks(rank: int, *, runs: int) -> dict[str, RefResult]:
    out = {}
    for overlap in (True, False):
        out[f"overlap={overlap}"] = engine_train(
            cpu_config(overlap=overlap, gas=2), make_batches(4 * 2, seed=1 + rank), 4,
            world_mean=True)
    for i in range(runs):  # engines built and closed again: the worker starts and stops
        engine_train(cpu_config(overlap=True), make_batches(1, seed=1 + rank), 1)
        del i
    return out


@pytest.mark.multiproc
def test_two_ranks_bit_identical_to_overlap_off_and_match_ddp(tmp_path: Path) -> None:
    """Two gloo ranks (each unit's reduce-scatter is waited for before it is handed
    over): overlap on == off bitwise, the ranks agree, parity with the DDP reference.
    Spawned three times: every child must exit 0 (mp.spawn raises otherwise; the harness
    skips interpreter finalization, which test_interpreter_exits_cleanly_with_the_worker
    covers with the worker alive)."""
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        run_dir.mkdir()
        results = run_two_ranks(run_dir, {"r": functools.partial(_ranks, runs=2)})
        if attempt:
            continue
        r0, r1 = results[0]["r"], results[1]["r"]
        on, off = r0["overlap=True"], r0["overlap=False"]
        assert on.losses == off.losses == r1["overlap=True"].losses
        for k in off.params:
            assert torch.equal(on.params[k], off.params[k]), k
            assert torch.equal(on.params[k], r1["overlap=True"].params[k]), k
        per_rank = [make_batches(4 * 2, seed=1 + r) for r in range(2)]
        ref = reference_train(make_model(), make_config(gas=2), per_rank, 4)
        assert_match(on.losses, on.params, ref.losses, ref.params)


def big_root_model() -> torch.nn.Module:
    """TinyLM whose embedding and head are each larger than a block: the engine cuts the
    root into several groups, the head's final early in backward."""
    torch.manual_seed(0)
    return TinyLM(n_blocks=3, vocab=512)


def test_root_groups_final_early_are_handed_over_during_backward() -> None:
    steps, gas = 4, 2
    batches = make_batches(steps * gas)
    eng, _, _, _ = engine.initialize(device="cpu", model=big_root_model(),
                                     config=cpu_config(overlap=True, gas=gas))
    try:
        root = eng.root
        assert sum(g.trainable for g in root.groups) >= 2, [g.key for g in root.groups]
        order: list[str] = []
        real = eng.step_driver.groups_final

        def spy(keys: list[str]) -> None:
            order.extend(keys)
            real(keys)

        eng.step_driver.groups_final = spy  # type: ignore[method-assign]
        for ids, tg in batches[:gas]:
            eng.backward(eng(ids, tg))
            eng.step()
        head = next(g.key for g in root.groups
                    if any(s.qname.startswith("head") for s in g.slots))
        emb = next(g.key for g in root.groups
                   if any(s.qname.startswith("emb") for s in g.slots))
        first_block = next(k for k in order if k.startswith("blocks.0/"))
        assert order.index(head) < order.index(first_block) < order.index(emb), order
        assert sorted(order) == sorted(eng._train_keys)  # each group once
    finally:
        eng.close()
    on = engine_train(cpu_config(overlap=True, gas=gas), batches, steps,
                      model=big_root_model())
    off = engine_train(cpu_config(overlap=False, gas=gas), batches, steps,
                       model=big_root_model())
    assert on.losses == off.losses
    for k, v in off.params.items():
        assert torch.equal(on.params[k], v), k
    ref = reference_train(big_root_model(), make_config(gas=gas), [batches], steps)
    torch.testing.assert_close(torch.tensor(on.losses), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)  # engine_helpers.LOSS_RTOL
    for k, want in ref.params.items():
        torch.testing.assert_close(on.params[k], want, rtol=0.0, atol=1e-5, msg=k)
