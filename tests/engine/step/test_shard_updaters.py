"""The CPU Adam's two update runners behind one ShardUpdater ([Note: shard updaters] in
offload/shard_updater.py): the same members, capabilities instead of type tests, a missing
capability refused by name."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import make_batches, make_config, make_model

import tierzero
from tierzero import engine
from tierzero.engine.config.schema import OffloadConfig, OptimizerOffloadConfig
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.step.in_place import InPlaceStep
from tierzero.engine.step.offloaded_adam import OffloadedAdam
from tierzero.engine.step.streamed import StreamedStep
from tierzero.offload import AdamHyper, step_seam
from tierzero.offload.shard_updater import ShardUpdater
from tierzero.offload.step_seam import TrainingStateError

MEMBERS = sorted(n for n in vars(ShardUpdater) if not n.startswith("_"))
CAPABILITIES = ("measures", "defers", "has_order")


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
    opt = eng.optimizer
    assert isinstance(opt, OffloadedAdam)
    return opt._runner


HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)


def test_the_stream_measures_and_refuses_deferral_by_name(streamed: ZeroEngine) -> None:
    runner = _runner(streamed)
    assert isinstance(runner, StreamedStep)
    assert (runner.measures, runner.defers, runner.has_order) == (True, False, True)
    opt = streamed.optimizer
    assert isinstance(opt, OffloadedAdam) and opt.can_measure and not opt.can_defer
    keys = streamed._train_keys
    with pytest.raises(TrainingStateError) as err:
        runner.defer(HYPER, 1.0, 1.0, keys)
    msg = str(err.value)
    for part in ("streamed optimizer step", "defer()", "`defers`", "can_defer"):
        assert part in msg, (part, msg)
    # what holds without the capability is a no-op: nothing deferred, or on a worker
    runner.settle()
    assert not runner.deferred
    assert runner.wait_groups(keys) is None and runner.drain() is None
    assert runner.worker_times() == (0.0, 0.0)
    # measuring: what is measured is consumed by grad_stats, one entry per group in order
    runner.begin_measure()
    runner.measure(keys[:1])
    assert list(runner.grad_stats(set())) == keys
    runner.forget_measured()


def test_a_refused_deferral_leaves_the_step_count_and_training_alone(
        streamed: ZeroEngine) -> None:
    opt = streamed.optimizer
    assert isinstance(opt, OffloadedAdam) and not opt.can_defer
    with pytest.raises(TrainingStateError, match=r"defer\(\).*`defers`"):
        opt.step(defer=streamed._train_keys)
    assert opt.steps == 0
    ids, tg = make_batches(1)[0]
    streamed.backward(streamed(ids, tg))
    streamed.step()
    assert opt.steps == 1 and streamed.global_steps == 1


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
    opt = in_place.optimizer
    assert isinstance(opt, OffloadedAdam) and opt.can_defer and opt.can_measure
    assert opt.step_order == keys and not opt.apply_step_order()
