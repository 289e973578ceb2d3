"""`TierZeroMixin`: training through a tierzero engine for any `transformers.Trainer`
subclass; `TierZeroTrainer` is the mixin over `transformers.Trainer` itself.

An existing Trainer script changes one class name and passes its config:

    trainer = TierZeroTrainer(model=model, args=args, train_dataset=ds,
                              data_collator=collator, tierzero_config="ds_config.json")
    trainer.train()            # or train(resume_from_checkpoint=True)
    trainer.save_model()       # a Hugging Face directory (a peft adapter for LoRA)
    trainer.close()            # the engine's files are removed; the model is whole again

A script built on a Trainer subclass (TRL's `SFTTrainer`, ...) puts the mixin first:

    class SFT(tierzero.TierZeroMixin, trl.SFTTrainer): pass
    trainer = SFT(model=..., args=SFTConfig(...), train_dataset=..., peft_config=...,
                  tierzero_config="ds_config.json")

The subclass keeps everything it does before training (TRL: tokenizing, chat templates,
packing, its collator, peft wrapping) and its `compute_loss` and `log` (TRL's loss and its
token-accuracy metrics); the mixin replaces the training loop, checkpoints and
`save_model` (see "What `train()` does" below). It must come before the Trainer class in
the bases (a TypeError says so otherwise). Before training the mixin turns on
activation checkpointing from the TrainingArguments, as `Trainer.train` does; NEFTune and
Liger kernels are refused.

`tierzero_config`: a native or DeepSpeed config (path, mapping or Config);
default `args.deepspeed`. DeepSpeed's `"auto"` values are filled from the
TrainingArguments as the HF DeepSpeed integration does (batch sizes, lr,
betas, eps, weight decay, clipping, bf16/fp16, warm-up and total steps,
bucket sizes from the model's hidden size). A DeepSpeed config without an
`optimizer` / `scheduler` section gets the Trainer's AdamW and
`lr_scheduler_type` (linear, cosine, constant, constant_with_warmup). A native
config is taken as written, except batch sizes it leaves unset.

What `train()` does, per optimizer step: `gradient_accumulation_steps` micro- batches
handed to `eng.train_batch` with `compute_loss` as the loss (layer-major when
`batch.schedule` resolves so, [Note: layer-major schedule] in engine/layer_major.py, and
then the model's own activation checkpointing is left off: each unit is recomputed in
backward anyway; else `eng.backward(loss)` and `eng.step()` per micro-batch; each loss
divided by the accumulation count), so the loss is the per-micro-batch mean, as
DeepSpeed computes it (`compute_loss` gets no `num_items_in_batch`; with one micro-batch
per step this is the Trainer's own loss). The data order is a
`DistributedSampler(seed=args.seed)` with `set_epoch`, so a resumed run sees the same
batches. Logging, `save_steps` and the callbacks follow the Trainer's flow
(DefaultFlowCallback); checkpoints are tierzero checkpoints
`output_dir/checkpoint-<step>` holding the trainer's position. Not supported:
`save_total_limit` (warned), evaluation during training, hyper-parameter search, and a
subclass's own `training_step` (TRL's activation-offload context): the mixin's loop
calls `compute_loss` directly.

Tested with transformers 5.24, peft 0.21 and TRL 1.16 (tests/engine/hf/test_hf_trainer.py,
tests/engine/hf/test_hf_trl.py); it uses the Trainer's `_remove_unused_columns` /
`_get_collator_with_removed_columns`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, DistributedSampler
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput

from tierzero.engine.checkpoint.layout import LATEST
from tierzero.engine.config import Config, ConfigError, load_config
from tierzero.engine.config.schema import SchedulerType
from tierzero.engine.engine import ZeroEngine
from tierzero.engine.hf.export import export_hf
from tierzero.engine.initialize import initialize
from tierzero.engine.layer_major import train_schedule

log = logging.getLogger(__name__)

_SCHEDULES: dict[str, SchedulerType] = {  # TrainingArguments.lr_scheduler_type -> ours
    "linear": "warmup_linear", "cosine": "warmup_cosine", "constant": "constant",
    "constant_with_warmup": "constant"}


class _EngineCall:
    """What compute_loss calls: the engine's forward; attributes read through to the model
    (`_get_name`, `config`, ... for the Trainer's label smoothing and checks)."""

    def __init__(self, eng: ZeroEngine) -> None:
        self._eng = eng

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._eng(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._eng.module, name)


def _read_source(source: Any) -> Mapping[str, Any] | None:
    """The parsed DeepSpeed/native mapping (to see which sections it has), if JSON or dict."""
    if isinstance(source, Mapping):
        return source
    if isinstance(source, str | os.PathLike) and os.fspath(source).endswith(".json"):
        with open(source, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, Mapping) else None
    return None


# The mixin's methods use the Trainer's attributes (args, model, callback_handler, ...):
# type-checked as a Trainer, at run time a plain class that goes before one in the bases.
if TYPE_CHECKING:
    _MixinBase = transformers.Trainer
else:
    _MixinBase = object


class TierZeroMixin(_MixinBase):
    """Training through tierzero for any `transformers.Trainer` subclass; list it first in
    the bases: `class SFT(TierZeroMixin, trl.SFTTrainer)` (see the module doc)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        if transformers.Trainer in mro and mro.index(transformers.Trainer) < mro.index(
                TierZeroMixin):
            raise TypeError(f"{cls.__name__}: TierZeroMixin must come before the Trainer "
                            f"class in the bases, e.g. class {cls.__name__}(TierZeroMixin, "
                            "SFTTrainer); after it, the Trainer's own train() would run")
        shadowed = [name for name in ("train", "save_model", "_move_model_to_device")
                    if _defined_before(mro, name, TierZeroMixin)]
        if shadowed:
            raise TypeError(f"{cls.__name__}: a class before TierZeroMixin in the bases "
                            f"defines {', '.join(shadowed)}, which the mixin must provide; "
                            "put TierZeroMixin first")

    def __init__(self, *args: Any, tierzero_config: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tierzero_config = tierzero_config
        self.engine: ZeroEngine | None = None

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """Nothing: the engine places every shard, so the whole model is never copied to the
        GPU first (Trainer.__init__ would do that)."""

    # -- config -------------------------------------------------------------------
    def tierzero_config_for(self, max_steps: int) -> Config:
        """The engine config: `tierzero_config` (or args.deepspeed) with "auto" values and
        unset batch sizes filled from the TrainingArguments for a run of `max_steps`."""
        a = self.args
        source = self.tierzero_config if self.tierzero_config is not None else a.deepspeed
        if source is None:
            raise ConfigError("tierzero_config", f"{type(self).__name__} needs a config: pass "
                              "tierzero_config='ds_config.json' (DeepSpeed or native) or "
                              "TrainingArguments(deepspeed=...)")
        if isinstance(source, Config):
            cfg = source.with_run_length(max_steps)  # a DeepSpeed "auto" run length, if any
        else:
            hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
            auto = {"per_device_train_batch_size": a.per_device_train_batch_size,
                    "gradient_accumulation_steps": a.gradient_accumulation_steps,
                    "learning_rate": a.learning_rate, "adam_beta1": a.adam_beta1,
                    "adam_beta2": a.adam_beta2, "adam_epsilon": a.adam_epsilon,
                    "weight_decay": a.weight_decay, "max_grad_norm": a.max_grad_norm,
                    "warmup_steps": a.get_warmup_steps(max_steps), "max_steps": max_steps,
                    "fp16": bool(a.fp16), "bf16": bool(a.bf16), "world_size": a.world_size,
                    "hidden_size": hidden if isinstance(hidden, int) else None}
            cfg = load_config(source, auto_values=auto)
            if cfg.source == "deepspeed":
                cfg = self._trainer_defaults(cfg, _read_source(source) or {}, max_steps)
        batch = cfg.batch
        for key, mine, theirs in (
                ("micro_batch_size", batch.micro_batch_size, a.per_device_train_batch_size),
                ("gradient_accumulation_steps", batch.gradient_accumulation_steps,
                 a.gradient_accumulation_steps)):
            if mine is not None and mine != theirs:
                raise ConfigError(f"batch.{key}", f"{mine} differs from the TrainingArguments' "
                                  f"{theirs}; make them equal (or 'auto' in a DeepSpeed config)")
        from dataclasses import replace
        return replace(cfg, batch=replace(batch, micro_batch_size=a.per_device_train_batch_size,
                                          gradient_accumulation_steps=a.gradient_accumulation_steps))

    def _trainer_defaults(self, cfg: Config, data: Mapping[str, Any], max_steps: int) -> Config:
        """What the HF DeepSpeed integration uses when the JSON leaves a section out: the
        Trainer's AdamW, its lr schedule, its seed."""
        from dataclasses import replace
        a = self.args
        if "optimizer" not in data:
            cfg = replace(cfg, optimizer=replace(
                cfg.optimizer, type="adamw", lr=float(a.learning_rate),
                betas=(float(a.adam_beta1), float(a.adam_beta2)), eps=float(a.adam_epsilon),
                weight_decay=float(a.weight_decay)))
        if "scheduler" not in data:
            kind = str(getattr(a.lr_scheduler_type, "value", a.lr_scheduler_type))
            if kind not in _SCHEDULES:
                raise ConfigError("lr_scheduler_type", f"{kind!r} has no tierzero schedule; "
                                  f"allowed: {', '.join(_SCHEDULES)}, or a DeepSpeed "
                                  "'scheduler' section")
            warm = 0 if kind == "constant" else a.get_warmup_steps(max_steps)
            cfg = replace(cfg, scheduler=replace(cfg.scheduler, type=_SCHEDULES[kind],
                                                 warmup_steps=warm, total_steps=max_steps,
                                                 min_lr=0.0, warmup_start_lr=0.0))
        if "gradient_clipping" not in data:
            cfg = replace(cfg, gradient_clipping=float(a.max_grad_norm or 0.0))
        return replace(cfg, seed=int(a.seed))

    # -- data ---------------------------------------------------------------------
    def _tierzero_loader(self) -> tuple[DataLoader[Any], DistributedSampler[Any]]:
        ds = self.train_dataset
        if ds is None or not hasattr(ds, "__len__"):
            raise ValueError(f"{type(self).__name__} needs a train_dataset with a length (a "
                             "map-style dataset); streaming datasets are not supported")
        collator = self.data_collator
        try:
            import datasets  # type: ignore[import-untyped,unused-ignore]
            is_hf = isinstance(ds, datasets.Dataset)
        except ImportError:
            is_hf = False
        if is_hf:
            ds = self._remove_unused_columns(ds, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        a = self.args
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        sampler: DistributedSampler[Any] = DistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=True, seed=a.seed,
            drop_last=a.dataloader_drop_last)
        loader: DataLoader[Any] = DataLoader(
            ds, batch_size=a.per_device_train_batch_size, sampler=sampler,
            collate_fn=collator, drop_last=a.dataloader_drop_last,
            num_workers=a.dataloader_num_workers)
        return loader, sampler

    # -- training -----------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train through a tierzero engine (see the module doc). The engine stays open
        afterwards for save_model(); close() ends it."""
        if trial is not None:
            raise ValueError(f"{type(self).__name__} does not support hyper-parameter "
                             "search (trial=)")
        a = self.args
        loader, sampler = self._tierzero_loader()
        accum = a.gradient_accumulation_steps
        per_epoch = max(1, len(loader) // accum)
        max_steps = a.max_steps if a.max_steps > 0 else math.ceil(a.num_train_epochs * per_epoch)
        config = self.tierzero_config_for(max_steps)
        if a.save_total_limit:
            log.warning("%s: save_total_limit=%s is not applied; tierzero checkpoints "
                        "are kept", type(self).__name__, a.save_total_limit)
        self.close()
        eng, _, _, _ = initialize(model=self._prepare_model(config), config=config)
        self.engine = eng
        start, consumed = self._resume(eng, resume_from_checkpoint)
        self.state = TrainerState(max_steps=max_steps, num_train_epochs=math.ceil(
            max_steps / per_epoch), train_batch_size=a.per_device_train_batch_size,
            global_step=start)
        self.state.compute_steps(a, max_steps)  # type: ignore[no-untyped-call,unused-ignore]
        self.state.log_history = self._resumed_history
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.control = self.callback_handler.on_train_begin(a, self.state, self.control)
        call = _EngineCall(eng)
        eng.train()
        t0 = time.perf_counter()
        total_loss, window, logged_at = 0.0, 0.0, start
        batches = self._batches(loader, sampler, consumed)
        for step in range(start + 1, max_steps + 1):
            micro = list(islice(batches, accum))
            if len(micro) != accum:
                raise RuntimeError(f"internal: {len(micro)} of {accum} micro-batches drawn")

            def loss_fn(inputs: Any) -> torch.Tensor:
                with self.compute_loss_context_manager():
                    loss = self.compute_loss(call, self._prepare_inputs(inputs))  # type: ignore[arg-type]
                if not isinstance(loss, torch.Tensor):
                    raise TypeError(f"compute_loss returned {type(loss).__name__}; expected "
                                    "the loss tensor")
                return loss

            # one optimizer step, layer-major or per micro-step (batch.schedule)
            losses = [float(v.item()) for v in eng.train_batch(micro, loss_fn)]
            consumed += accum
            step_loss = _mean_over_ranks(sum(losses) / accum)
            total_loss += step_loss
            window += step_loss
            self.state.global_step = step
            self.state.epoch = consumed / (per_epoch * accum)
            self.control = self.callback_handler.on_step_end(a, self.state, self.control)
            if self.control.should_log or step == max_steps:
                logs = {"loss": window / (step - logged_at), "learning_rate": eng.get_lr()[0]}
                grad_norm = eng.get_global_grad_norm()  # with clipping on or off
                if grad_norm is not None:
                    logs["grad_norm"] = float(grad_norm)
                self.log(logs)
                window, logged_at = 0.0, step
                self.control.should_log = False
            if self.control.should_save:
                self._save_tierzero(eng, step, consumed)
                self.control.should_save = False
            if self.control.should_training_stop:
                break
        run_s = time.perf_counter() - t0
        self.control = self.callback_handler.on_train_end(a, self.state, self.control)
        steps_run = self.state.global_step - start
        metrics = {"train_runtime": run_s, "train_loss": total_loss / max(1, steps_run),
                   "train_steps_per_second": steps_run / run_s if run_s else 0.0}
        self.log(dict(metrics))
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _prepare_model(self, config: Config) -> torch.nn.Module:
        """What Trainer.train does to the model before its loop and a script relies on:
        activation checkpointing from the TrainingArguments (TRL's SFTConfig turns it on
        by default). NEFTune and Liger kernels, which the Trainer also applies there, are
        refused rather than silently left out. Returns the model."""
        a, model = self.args, self.model
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"{type(self).__name__} needs model= (an nn.Module)")
        for name in ("neftune_noise_alpha", "use_liger_kernel"):
            if getattr(a, name, None):
                raise ValueError(f"{type(self).__name__}: TrainingArguments.{name} is not "
                                 "supported with tierzero; unset it")
        # transformers >= 5 names it activation_checkpointing; before, gradient_checkpointing
        on = getattr(a, "activation_checkpointing", getattr(a, "gradient_checkpointing", False))
        if not on:
            return model
        accum = config.batch.gradient_accumulation_steps or 1
        if train_schedule(config, accum) == "layer_major":
            # [Note: layer-major schedule]: every unit is recomputed in backward already;
            # the model's own (reentrant) checkpointing would only make it fall back
            log.info("%s: activation checkpointing not turned on: batch.schedule "
                     "layer_major recomputes each unit in backward", type(self).__name__)
            return model
        kwargs = dict(getattr(a, "activation_checkpointing_kwargs", None)
                      or getattr(a, "gradient_checkpointing_kwargs", None) or {})
        hf: Any = model  # a PreTrainedModel or a peft wrapper around one
        if hasattr(hf, "activation_checkpointing_enable"):
            every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                               every_n_layers=every, offload=offload)
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
        return model

    def _batches(self, loader: DataLoader[Any], sampler: DistributedSampler[Any],
                 consumed: int) -> Iterator[Any]:
        """Micro-batches from position `consumed` (counted from the start of training) on,
        epoch after epoch; each epoch's order depends only on (seed, epoch)."""
        n = len(loader)
        epoch, skip = divmod(consumed, n)
        while True:
            sampler.set_epoch(epoch)
            yield from islice(iter(loader), skip, None)
            epoch, skip = epoch + 1, 0

    # -- checkpoints ----------------------------------------------------------------
    def _save_tierzero(self, eng: ZeroEngine, step: int, consumed: int) -> None:
        tag = f"checkpoint-{step}"
        eng.save_checkpoint(self._output_dir(), tag=tag,
                            client_state={"trainer": {"step": step, "consumed": consumed,
                                                      "log_history": self.state.log_history}})
        log.info("tierzero checkpoint %s", self._output_dir() / tag)

    def _output_dir(self) -> Path:
        if not self.args.output_dir:
            raise ValueError("TrainingArguments.output_dir is not set; checkpoints go there")
        return Path(self.args.output_dir)

    def _resume(self, eng: ZeroEngine, source: str | bool | None) -> tuple[int, int]:
        """(steps done, micro-batches consumed) of the checkpoint `source` names; (0, 0)."""
        self._resumed_history: list[dict[str, Any]] = []
        if source is None or source is False:
            return 0, 0
        if source is True:
            root, tag = self._output_dir(), None
            if not (root / LATEST).is_file():
                raise ValueError(f"resume_from_checkpoint=True: no tierzero checkpoint in "
                                 f"{root} (no {LATEST} file); pass a checkpoint directory")
        else:
            root, tag = Path(source).parent, Path(source).name
        path, client = eng.load_checkpoint(root, tag)
        pos = client.get("trainer") if isinstance(client, dict) else None
        if not isinstance(pos, dict) or not {"step", "consumed"} <= set(pos):
            raise ValueError(f"{path} was not saved by TierZeroTrainer (no trainer position "
                             "in its client_state)")
        self._resumed_history = list(pos.get("log_history", []))
        log.info("resumed from %s at step %d", path, pos["step"])
        return int(pos["step"]), int(pos["consumed"])

    # -- output -------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained model as a Hugging Face directory in `output_dir` (default
        args.output_dir): full weights, or a peft adapter for a LoRA model; the tokenizer
        (processing_class) too. Files already there are never overwritten."""
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        out = Path(output_dir) if output_dir else self._output_dir()
        staging = out / ".tierzero-export"
        if self.engine.comm.rank == 0 and staging.exists():
            shutil.rmtree(staging)  # ours: left by a killed save_model
        export_hf(self.engine, staging)
        if self.engine.comm.rank == 0:
            for f in sorted(staging.iterdir()):
                if (out / f.name).exists():
                    raise FileExistsError(f"save_model: {out / f.name} exists; pick another "
                                          "output_dir (files are never overwritten)")
            for f in sorted(staging.iterdir()):
                f.rename(out / f.name)
            staging.rmdir()
            if self.processing_class is not None and hasattr(self.processing_class,
                                                             "save_pretrained"):
                self.processing_class.save_pretrained(str(out))

    def close(self) -> None:
        """End the engine: swap files removed, every parameter whole in `self.model` again."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _mean_over_ranks(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _defined_before(mro: tuple[type, ...], name: str, mixin: type) -> bool:
    """Whether a class before `mixin` in `mro` defines `name` itself."""
    return any(name in vars(c) for c in mro[1:mro.index(mixin)])


class TierZeroTrainer(TierZeroMixin, transformers.Trainer):
    """`transformers.Trainer` with training through tierzero (see the module doc)."""
