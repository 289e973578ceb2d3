"""The training job behind `tierzero train`: build, partition, train, record.

Composition in order (one place): checks on everything a user gave (before
any work), process group, data, model, engine, then the step loop.
Rank 0 shows the progress bar, logs a line every logging.steps_per_print
steps and writes the metrics file, the trace and the plot.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from tierzero import engine
from tierzero.engine.config import Config
from tierzero.engine.config.train import TrainConfig
from tierzero.engine.hf import apply_lora, export_hf
from tierzero.engine.hf.export import is_hf_model
from tierzero.engine.train import checkpoints, disk_full
from tierzero.engine.train.bg_saves import SaveTracker
from tierzero.engine.train.checkpoints import TrainError
from tierzero.engine.train.data import Batch, Batches, TrainData, load_data
from tierzero.engine.train.evaluation import eval_event, token_loss
from tierzero.engine.train.interrupt import StopSignals
from tierzero.engine.train.metrics import (
    CpuCounter,
    DiskCounter,
    MetricsWriter,
    StepRecord,
    TierCounter,
    end_event,
    log_line,
    run_event,
    tier_bytes,
)
from tierzero.engine.train.model_source import build_model, model_dir, pretrained_dir
from tierzero.engine.train.setup import (
    TrainOptions,
    any_over_ranks,
    check_settings,
    init_process_group,
    mean_over_ranks,
    run_dir_for,
    run_locks,
    tensorboard_sink,
)
from tierzero.engine.train.timeline import TraceWindow
from tierzero.swap.safe_files import output_modes

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: str
    metrics_path: str
    records: list[StepRecord] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # the "eval" metrics events
    trace_path: str | None = None
    plot_path: str | None = None
    export_path: str | None = None  # the Hugging Face directory written at the end


def _export(eng: engine.ZeroEngine, tc: TrainConfig, out: str) -> str:
    """Write the model as a Hugging Face directory (engine/hf/export.py); a collective."""
    ex = tc.export
    tokenizer = (None if tc.tokenizer == "bytes" else
                 tc.tokenizer if tc.tokenizer is not None else model_dir(tc.model))
    path = export_hf(eng, out, dtype=ex.dtype, lora=ex.lora, max_shard_bytes=ex.max_shard_bytes,
                     tokenizer_from=tokenizer)
    log.info("Hugging Face model written to %s", path)
    return str(path)


class TrainStopped(Exception):
    """The run stopped on SIGINT/SIGTERM, cleaned up ([Note: stopping a run] in
    interrupt.py). `line`: the one line for the user; `exit_code`: 128 + the signal."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.line = line
        self.exit_code = exit_code


@dataclass
class _Progress:
    """How far the run got and its newest checkpoint: for the stop line and error messages."""

    done: int = 0  # optimizer steps completed (counted from the start of training)
    checkpoint: str | None = None  # the newest complete checkpoint this run saved or resumed
    checkpoint_dir: str | None = None  # where this run saves
    saving: bool = False  # a checkpoint of step `done` is being written
    saves: SaveTracker | None = None  # background saves: started, finished, their cost
    saved: str | None = None  # the newest checkpoint this run began to save (complete or not)
    pending: tuple[str, engine.PendingSave] | None = None  # a background save not yet seen done

    def save(self, eng: engine.ZeroEngine, ckpt_dir: str, batches: Batches,
             background: bool) -> None:
        """Save step `done`; an interrupt while writing is reported as the save abandoned
        (the partial directory is removed, the previous checkpoint stays the newest)."""
        self.saving = True
        path, result = checkpoints.save(eng, ckpt_dir, self.done, batches,
                                        background=background)
        self.saving = False
        self.newest()  # the previous background save is complete (the call waited for it)
        self.saved = path
        if isinstance(result, engine.PendingSave) and not result.done():
            self.pending = (path, result)  # the newest complete one once it succeeds
        else:
            self.checkpoint = path
        if self.saves is not None:
            self.saves.started(result, f"step{self.done}", self.done)

    def newest(self) -> str | None:
        """The newest complete checkpoint: a background save counts once it succeeded."""
        if self.pending is not None and self.pending[1].done():
            path, pending = self.pending
            self.pending = None
            if pending.future.exception() is None:
                self.checkpoint = path
        return self.checkpoint

    def last_good(self, *, wait: bool = False) -> str:
        """The newest complete checkpoint, for an error message. `wait`: the run stops with
        its state intact (a non-finite loss or norm, caught before it reached the model),
        so a background save still writing finishes first and counts if it succeeds."""
        if wait and self.pending is not None:
            with contextlib.suppress(Exception):  # a failed save is simply not counted
                self.pending[1].wait()
        if self.newest() is None:
            return "no checkpoint was saved or resumed from (set train.checkpoint_interval)"
        return f"the last good checkpoint is {self.checkpoint}"

    def resume_hint(self, tc: TrainConfig) -> str:
        if self.newest() is None or self.checkpoint is None:
            return ("nothing to resume from: no checkpoint was saved (set "
                    "train.checkpoint_interval, or train.save_on_interrupt: true)")
        where = Path(self.checkpoint)
        if tc.checkpoint_dir is not None and where.parent == Path(tc.checkpoint_dir):
            return (f"resume with train.resume: true (train.checkpoint_dir "
                    f"{tc.checkpoint_dir}, newest checkpoint {where.name})")
        return f"resume with train.resume: {where}"


def run(config: Config, options: TrainOptions) -> TrainResult:
    """Train; raises TrainStopped after a SIGINT/SIGTERM stopped the run (cleaned up)."""
    progress = _Progress()
    with StopSignals() as stop:
        try:
            with run_locks(config.train):  # first: a second run hears why it cannot start
                check_settings(config, options)
                created_group = init_process_group()
                try:
                    return _train(config, options, stop, progress)
                finally:
                    if created_group:
                        dist.destroy_process_group()
        except _Stopped:  # (before the handler of every other Exception)
            pass
        except Exception as exc:
            full = disk_full.describe(exc, checkpoint_dir=progress.checkpoint_dir,
                                      last_good=progress.last_good())
            if full is None:
                raise
            raise TrainError(full) from exc
        except KeyboardInterrupt:  # a step abandoned ([Note: stopping a run])
            stop.interrupted()
    abandoned = f"saving step{progress.done}" if progress.saving else f"step {progress.done + 1}"
    what = stop.name + (f"; {abandoned} abandoned" if stop.abandoned else "")
    raise TrainStopped(f"stopped at step {progress.done} ({what}); "
                       f"{progress.resume_hint(config.train)}", stop.exit_code)


class _Stopped(Exception):
    """Internal: the loop stopped at a step boundary on a signal (engine already closed)."""


@dataclass
class _Job:
    """What the run trains: its resolved config, data and engine, from step `start`."""

    config: Config  # world size checked, run length filled
    data: TrainData
    eng: engine.ZeroEngine
    n_params: int
    start: int  # optimizer steps already done (a resumed run's)
    rank: int
    world: int


@dataclass
class _Outputs:
    """What the run writes and where: metrics (rank 0), trace window, checkpoints, exports."""

    result: TrainResult
    window: TraceWindow
    writer: MetricsWriter | None  # rank 0
    disk: DiskCounter
    cpu: CpuCounter
    moves: TierCounter
    saves: SaveTracker  # background saves (also progress.saves, which starts them)
    ckpt_dir: str
    export_dir: str


def _train(config: Config, options: TrainOptions, stop: StopSignals,
           progress: _Progress) -> TrainResult:
    """The run composed in order: data, model, engine (_start), outputs, the step loop
    (_steps), the end of the run (_wrap_up); the engine closed however it ends."""
    job = _start(config, stop, progress)
    out = _open_outputs(job, options, progress)
    tc = job.config.train
    try:
        if out.writer:
            out.writer.write(run_event(job.config, tc.model, job.n_params,
                                       units=len(job.eng.units), world=job.world,
                                       source=job.data.source, start_step=job.start,
                                       tokenizer=job.data.tokenizer.name, mode=job.data.mode,
                                       eval_source=job.data.eval_source))
        if job.data.eval:
            out.result.evals.append(eval_event(job.eng, job.data.eval, job.start,
                                               world=job.world, writer=out.writer))
        with logging_redirect_tqdm():
            _steps(job, out, options, stop, progress)
        _wrap_up(job, out, stop, progress)
    finally:
        out.window.close()
        if stop.abandoned:
            out.saves.abandon()
        job.eng.close(restore_params=False)  # nothing reads the model after the run
        if out.writer:
            out.writer.close()
    if stop.requested:
        raise _Stopped
    if job.rank == 0:
        _write_outputs(out.result, out.window)
    return out.result


def _start(config: Config, stop: StopSignals, progress: _Progress) -> _Job:
    """Data, model and engine, resumed or with pretrained weights loaded (in that order)."""
    tc = config.train
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    config = config.check_world_size(world)
    micro = config.batch.micro_batch_size or 1
    accum = config.batch.gradient_accumulation_steps or 1
    data = load_data(tc, micro=micro, accum=accum, seed=config.seed, rank=rank, world=world)
    # The run length is known now (train.epochs may have set it): fill DeepSpeed's
    # "auto" total_num_steps ([Note: auto run length] in engine/config/hf_auto.py).
    config = replace(config, train=replace(tc, steps=data.steps)).with_run_length(data.steps)
    tc = config.train

    torch.manual_seed(config.seed)  # the same initial weights on every rank
    t0 = time.perf_counter()
    # Under stage 3 the model is built straight into per-rank shards (engine.Init, on NVMe
    # with offload.params.device nvme): a config.json model never exists whole in host
    # memory (fp32, 4 B/param) on its way to the tiers. Values equal a plain build.
    with engine.Init(config=config):
        model = build_model(tc.model, tc.seq_len, data.tokenizer.vocab_size,
                            data.tokenizer.name)
    model = apply_lora(model, tc.lora)
    n_params = sum(p.numel() for p in model.parameters())
    if tc.lora.r:
        log.info("LoRA r=%d: %d of %d parameters train (the base is frozen)", tc.lora.r,
                 sum(p.numel() for p in model.parameters() if p.requires_grad), n_params)
    eng, _, _, _ = engine.initialize(model=model, config=config)
    try:
        start = _resume_or_load(eng, data.batches, tc, rank=rank, stop=stop,
                                progress=progress)
    except BaseException:
        eng.close(restore_params=False)
        raise
    log.info("model %s: %.1fM parameters, %d units, built and partitioned in %.1f s",
             tc.model, n_params / 1e6, len(eng.units), time.perf_counter() - t0)
    return _Job(config, data, eng, n_params, start, rank, world)


def _resume_or_load(eng: engine.ZeroEngine, batches: Batches, tc: TrainConfig, *, rank: int,
                    stop: StopSignals, progress: _Progress) -> int:
    """Resume from train.resume's checkpoint, else load the model's pretrained weights
    (if any); the optimizer steps already done."""
    resume_from = checkpoints.resume_source(tc)  # (under the lock: no save in progress)
    if resume_from is not None and resume_from.tag is not None and tc.resume is True \
            and rank == 0:
        checkpoints.repair_latest(resume_from.directory, resume_from.tag)
    start = checkpoints.resume(eng, batches, resume_from) if resume_from is not None else 0
    if resume_from is not None:
        progress.checkpoint = checkpoints.resolved_path(resume_from)
    progress.done = start
    stop.at_step(start)
    if tc.checkpoint_dir is not None:  # (a new run directory holds no checkpoints)
        checkpoints.check_no_overwrite(tc, tc.checkpoint_dir, start)
    weights = pretrained_dir(tc.model) if resume_from is None else None
    if weights is not None:
        loaded = engine.load_pretrained(eng, weights)
        log.info("loaded pretrained weights from %s: %d tensors, %d bytes read",
                 weights, loaded.tensors, loaded.bytes_read)
    return start


def _open_outputs(job: _Job, options: TrainOptions, progress: _Progress) -> _Outputs:
    """The run directory's metrics file (rank 0), trace window, counters and save tracker."""
    tc = job.config.train
    rank0 = job.rank == 0
    run_dir = run_dir_for(job.config, rank0)
    metrics_path = tc.metrics_path or os.path.join(run_dir, "metrics.jsonl")
    ckpt_dir = progress.checkpoint_dir = checkpoints.checkpoint_dir(tc, run_dir)
    first, count = options.trace_steps
    window = TraceWindow(options.trace_path if rank0 else None, first, count,
                         process=f"tierzero train (rank {job.rank})")
    disk = DiskCounter()
    cpu = CpuCounter()
    moves = TierCounter(job.eng.memory_report())
    modes = output_modes(job.config.outputs.permissions)
    writer = MetricsWriter(metrics_path, modes, also=tensorboard_sink(tc, run_dir, modes)) \
        if rank0 else None
    saves = progress.saves = SaveTracker(writer.write if writer else None, rank0)
    return _Outputs(TrainResult(run_dir, metrics_path, trace_path=options.trace_path,
                                plot_path=options.plot_path),
                    window, writer, disk, cpu, moves, saves, ckpt_dir,
                    tc.export.dir or os.path.join(run_dir, "hf"))


def _steps(job: _Job, out: _Outputs, options: TrainOptions, stop: StopSignals,
           progress: _Progress) -> None:
    """The step loop, from job.start + 1 to train.steps or a stop signal on any rank."""
    eng, data, tc, world = job.eng, job.data, job.config.train, job.world
    rank0 = job.rank == 0
    accum = job.config.batch.gradient_accumulation_steps or 1
    bar = tqdm(range(job.start + 1, tc.steps + 1), desc="train", unit="step",
               initial=job.start, total=tc.steps, disable=not (rank0 and options.progress))
    for step in bar:
        if any_over_ranks(stop.signum or 0, world):  # every rank stops at one step
            break
        out.window.before(step)
        try:
            record = _one_step(eng, data.batches, disk=out.disk, cpu=out.cpu, moves=out.moves,
                               step=step, accum=accum, world=world)
        except _NonFinite as exc:
            raise TrainError(f"step {step}: {exc}; "
                             f"{progress.last_good(wait=True)}") from None
        if data.eval and (step == tc.steps or (
                tc.eval_interval and step % tc.eval_interval == 0)):
            # (inside the traced step, so every trace event lies in a step span)
            out.result.evals.append(eval_event(eng, data.eval, step, world=world,
                                               writer=out.writer))
        out.window.after(step)
        progress.done = step
        stop.at_step(step)
        out.result.records.append(record)
        out.saves.after_step(record.step_s)
        bar.set_postfix(loss=f"{record.loss:.3f}")
        if out.writer:
            out.writer.write(record.as_json())
        if rank0 and (step % job.config.logging.steps_per_print == 0 or step == tc.steps):
            log.info("%s", log_line(record, tc.steps))
        if eng.nonfinite_steps_in_row >= tc.max_nonfinite_steps:
            raise TrainError(
                f"step {step}: the gradient norm was not finite in "
                f"{eng.nonfinite_steps_in_row} optimizer steps in a row (each skipped, "
                f"train.max_nonfinite_steps: {tc.max_nonfinite_steps}); "
                f"{progress.last_good(wait=True)}")
        if tc.checkpoint_interval and step % tc.checkpoint_interval == 0:
            progress.save(eng, out.ckpt_dir, data.batches, tc.checkpoint_background)
            if tc.export.at_checkpoints:
                _export(eng, tc, os.path.join(out.export_dir, f"step{step}"))
        stop.step_done()
    bar.close()


def _wrap_up(job: _Job, out: _Outputs, stop: StopSignals, progress: _Progress) -> None:
    """After the loop: a stopped run saves (train.save_on_interrupt), a finished one
    exports (train.export.at_end); the last background save and the summary event."""
    tc = job.config.train
    signum = int(any_over_ranks(stop.signum or 0, job.world))
    if signum:
        stop.request(signum)
        if tc.save_on_interrupt and progress.done > job.start and (
                progress.saved is None
                or Path(progress.saved).name != f"step{progress.done}"):
            progress.save(job.eng, out.ckpt_dir, job.data.batches, tc.checkpoint_background)
    elif tc.export.at_end and is_hf_model(job.eng.module):  # (a stopped run exports nothing)
        out.result.export_path = _export(job.eng, tc, os.path.join(out.export_dir, "final"))
    out.saves.finish()  # the last background save, reported before the summary
    if out.writer:
        out.writer.write(end_event(out.result.records, out.result.evals,
                                  stop.name if signum else None))


class _NonFinite(Exception):
    """Internal: a micro-step's loss is NaN or infinite on some rank."""


def _one_step(eng: engine.ZeroEngine, batches: Batches, *,
              disk: DiskCounter, cpu: CpuCounter, moves: TierCounter, step: int, accum: int,
              world: int) -> StepRecord:
    cpu.delta()  # the step's CPU from here (not the evaluation or saves between steps)
    start = time.perf_counter()
    wait_before = eng.scheduler.gather_s  # every unit gather, forward and backward
    # the CPU Adam's worker beside compute, and forward waiting for deferred updates
    times_before = eng.optimizer_times()
    step_before = eng.optimizer_step_s
    micro_batches = [batches.next() for _ in range(accum)]  # (B, T) inputs, labels
    n_tokens = sum(x.numel() for x, _ in micro_batches)

    def loss_fn(mb: Batch) -> torch.Tensor:
        x, y = mb
        out = eng(input_ids=x)
        logits = out.logits if hasattr(out, "logits") else out[0]  # (B, T, V)
        return token_loss(logits, y)  # (IGNORE labels carry no loss)

    losses: list[float] = []  # each micro-batch's loss, read once (a device sync each)

    def check(new: list[torch.Tensor]) -> None:
        # before any of their gradients reach a shard: the model state stays unchanged
        values = [float(v.item()) for v in new]
        bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
        first = len(losses)
        losses.extend(values)
        if any_over_ranks(0.0 if bad is None else 1.0, world):
            where = (f"the loss is {values[bad]} (not finite) at micro-step {first + bad}"
                     if bad is not None else "a loss is not finite on another rank")
            raise _NonFinite(f"{where}; stopped before its gradients reached the model, so "
                             "the model state is unchanged")

    # one optimizer step: layer-major or per micro-step (batch.schedule)
    eng.train_batch(micro_batches, loss_fn, check_losses=check)
    optimizer_s = eng.optimizer_step_s - step_before
    step_s = time.perf_counter() - start
    wait_s = eng.scheduler.gather_s - wait_before
    times_after = eng.optimizer_times()
    optimizer_s += times_after.update_wait_s - times_before.update_wait_s
    read, written = disk.delta()
    cpu_s, steal_s = cpu.delta()
    report = eng.memory_report()
    now, peak = tier_bytes(report)
    moved, stall = moves.delta(report)
    total_tokens = n_tokens * world
    return StepRecord(
        step=step, loss=mean_over_ranks(sum(losses) / len(losses), world),
        lr=eng.get_lr()[0], grad_norm=eng.get_global_grad_norm(),
        clip_coef=eng.get_clip_coef(), tokens=total_tokens, tokens_per_s=total_tokens / step_s,
        step_s=step_s, compute_s=max(0.0, step_s - optimizer_s - wait_s), wait_s=wait_s,
        optimizer_s=optimizer_s,
        optimizer_hidden_s=times_after.hidden_s - times_before.hidden_s,
        optimizer_worker_s=times_after.worker_s - times_before.worker_s,
        tier_bytes=now, tier_peak_bytes=peak,
        nvme_read_bytes=read, nvme_written_bytes=written,
        nvme_read_gbps=read / step_s / 1e9, nvme_write_gbps=written / step_s / 1e9,
        rss_bytes=disk.rss(), moved_bytes=moved, io_stall_s=stall,
        grad_home=(report.get("tiers") or {}).get("grad_home"),
        update=eng.step_driver.last_update, cpu_cores=cpu_s / step_s,
        steal_cores=None if steal_s is None else steal_s / step_s)


def _write_outputs(result: TrainResult, window: TraceWindow) -> None:
    if result.trace_path:
        window.write()
        log.info("trace: %s (%d events; open in ui.perfetto.dev or chrome://tracing)",
                 result.trace_path, len(window.events))
    if result.plot_path:
        from tierzero.engine.train.plot import plot_run
        plot_run(result.records, result.plot_path)
        log.info("plot: %s", result.plot_path)
    log.info("metrics: %s", result.metrics_path)


def with_steps(config: Config, steps: int | None) -> Config:
    """config with train.steps replaced (the --steps flag)."""
    if steps is None:
        return config
    if steps < 1:
        raise TrainError(f"--steps {steps}: allowed: an int >= 1")
    return replace(config, train=replace(config.train, steps=steps, epochs=0))
