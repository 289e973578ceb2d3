"""The CPU Adam's two update runners behind one ShardUpdater ([Note: shard updaters] in
offload/shard_updater.py): the same members, capabilities instead of type tests, a missing
capability refused by name."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import make_config, make_model

import tierzero
from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.offloaded import OffloadedStep, StepMode, step_mode
from tierzero.engine.step.offloaded_adam import OffloadedAdam
from tierzero.engine.step.streamed import StreamedStep
from tierzero.offload import AdamHyper, step_seam
from tierzero.offload.shard_updater import ShardUpdater
from tierzero.offload.step_seam import TrainingStateError

MEMBERS = sorted(n for n in vars(ShardUpdater) if not n.startswith("_"))
CAPABILITIES = ("measures", "defers", "has_order", "speculates")


def test_training_state_error_is_public_and_offloads_class() -> None:
    assert tierzero.TrainingStateError is step_seam.TrainingStateError
    assert "TrainingStateError" in tierzero.__all__
    from tierzero import TrainingStateError as imported
    assert imported is TrainingStateError


@pytest.mark.parametrize("runner", [InPlaceStep, StreamedStep])
def test_each_runner_has_every_member_of_the_protocol(runner: type) -> None:
    assert set(CAPABILITIES) <= set(MEMBERS)
    for name in MEMBERS:
        want = inspect.getattr_static(ShardUpdater, name)
        got = inspect.getattr_static(runner, name, None)
        assert got is not None, f"{runner.__name__} has no {name}"
        if isinstance(want, property):
            # a capability is a constant of the class; other properties are properties
            ok = isinstance(got, bool) if name in CAPABILITIES else isinstance(got, property)
            assert ok, (runner.__name__, name, got)
            continue
        assert callable(got), (runner.__name__, name)
        assert (list(inspect.signature(got).parameters)
                == list(inspect.signature(want).parameters)), (runner.__name__, name)


def _engine(tmp_path: Path, device: str) -> ZeroEngine:
    """Optimizer state offloaded to `device` (nvme: streamed; cpu: in place)."""
    optimizer = OptimizerOffloadConfig(device=device, path=str(tmp_path))  # type: ignore[arg-type]
    cfg = dataclasses.replace(make_config(), offload=OffloadConfig(optimizer=optimizer))
    eng, _, _, _ = engine.initialize(device="cpu", model=make_model(), config=cfg)
    return eng


@pytest.fixture
def streamed(tmp_path: Path) -> Iterator[ZeroEngine]:
    eng = _engine(tmp_path, "nvme")
    yield eng
    eng.close()


@pytest.fixture
def in_place(tmp_path: Path) -> Iterator[ZeroEngine]:
    eng = _engine(tmp_path, "cpu")
    yield eng
    eng.close()


def _runner(eng: ZeroEngine) -> ShardUpdater:
    driver = eng.step_driver
    assert isinstance(driver, OffloadedStep)
    return driver.runner


HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def test_the_stream_measures_and_defers(streamed: ZeroEngine) -> None:
    """Both runners measure and defer ([Note: deferred streamed step] for the stream): a
    deferred update is pending until waited for group by group or drained; its worker's
    time is counted; measurements are consumed by grad_stats, one entry per group."""
    runner = _runner(streamed)
    assert isinstance(runner, StreamedStep)
    assert (runner.measures, runner.defers, runner.has_order) == (True, True, True)
    keys = streamed._train_keys
    runner.settle()  # nothing on a worker yet
    assert not runner.deferred
    assert runner.wait_groups(keys) is None and runner.drain() is None
    runner.defer(HYPER, 1.0, 1.0, list(reversed(keys)))
    assert runner.deferred and runner.order == list(reversed(keys))  # the order given
    # the first group of that order: the stats come once every group has run (the worker
    # may have run them all by now), else from drain()
    stats = runner.wait_groups(keys[-1:]) or runner.drain()
    assert stats is not None and stats.shards == len(keys) and not runner.deferred
    busy, hidden = runner.worker_times()
    assert 0.0 <= hidden <= busy
    runner.begin_measure()
    runner.measure(keys[:1])
    assert list(runner.grad_stats(set())) == keys
    runner.forget_measured()


def test_the_stream_takes_an_order_and_the_in_place_step_has_none(
        streamed: ZeroEngine, in_place: ZeroEngine) -> None:
    stream = _runner(streamed)
    keys = streamed._train_keys
    assert sorted(stream.order) == sorted(keys)
    backwards = list(reversed(stream.order))
    assert stream.set_order(backwards) and stream.order == backwards
    assert not stream.set_order(backwards)  # the same order: no change

    runner = _runner(in_place)
    assert isinstance(runner, InPlaceStep)
    assert (runner.measures, runner.defers, runner.has_order) == (True, True, False)
    keys = in_place._train_keys
    assert runner.order == keys
    assert not runner.set_order(list(reversed(keys))) and runner.order == keys
    runner.flush()  # no write in flight: updates write their shards before they return
    assert in_place.step_driver.step_order == keys


@pytest.mark.parametrize(("overlap", "every_grad", "grads_in_host", "measures", "defers", "want"), [
    (True, False, True, True, True, StepMode.EARLY),  # begun during backward
    (True, False, False, False, False, StepMode.EARLY),
    (True, True, True, True, True, StepMode.DEFER),  # clipping / fp16, in place
    (True, True, True, True, False, StepMode.MEASURE),  # a runner that cannot defer
    (False, True, False, True, True, StepMode.MEASURE),  # gradients may leave host memory
    (False, True, True, True, True, StepMode.AFTER),  # nothing beside backward pays
    (True, True, True, False, False, StepMode.AFTER),  # a runner that cannot measure
])
def test_the_step_mode_follows_the_settings_and_the_runners_capabilities(  # noqa: PLR0917
        overlap: bool, every_grad: bool, grads_in_host: bool, measures: bool, defers: bool,
        want: StepMode) -> None:
    class Runner:
        pass

    runner = Runner()
    runner.measures, runner.defers = measures, defers  # type: ignore[attr-defined]
    assert step_mode(runner, overlap=overlap, needs_every_grad=every_grad,  # type: ignore[arg-type]
                     grads_in_host=grads_in_host) is want


def test_the_optimizer_face_is_stepped_by_the_engine_only(streamed: ZeroEngine) -> None:
    """OffloadedAdam is the torch.optim face (param group, step count): its step() names
    the call to make; it holds no runner or driver to forward to."""
    opt = streamed.optimizer
    assert isinstance(opt, OffloadedAdam)
    with pytest.raises(TrainingStateError, match=r"eng\.step\(\)"):
        opt.step()
    held = {type(v).__name__ for v in vars(opt).values()}
    assert not held & {"OffloadedStep", "InPlaceStep", "StreamedStep", "AdamStream"}, held
    opt.param_groups[0]["lr"] = 0.25  # what the lr schedule changes, the next update uses
    assert opt.hyper().lr == 0.25 and opt.steps == 0
