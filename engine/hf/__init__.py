"""Hugging Face integration: LoRA through peft, model directories out, and the Trainer.

`export_hf` writes a live engine's model as a directory `from_pretrained` loads;
`apply_lora` wraps a model in peft adapters from `train.lora`. The Trainer mixin and
subclass (`tierzero.engine.hf.trainer.TierZeroMixin`, `TierZeroTrainer`) import
transformers, so they are not imported here: `tierzero.TierZeroMixin` and
`tierzero.TierZeroTrainer` load them on first use.
"""

from tierzero.engine.hf.export import ExportError, export_hf
from tierzero.engine.hf.lora import LoraError, apply_lora, peft_aliases

__all__ = ["ExportError", "LoraError", "apply_lora", "export_hf", "peft_aliases"]
