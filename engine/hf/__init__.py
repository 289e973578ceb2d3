"""Hugging Face integration: LoRA through peft, model directories out, and the Trainer.

`export_hf` writes a live engine's model as a directory `from_pretrained` loads;
`apply_lora` wraps a model in peft adapters from `train.lora`. The Trainer
subclass (`tierzero.engine.hf.trainer.TierZeroTrainer`) imports transformers,
so it is not imported here: `tierzero.TierZeroTrainer` loads it on first use.
"""

from tierzero.engine.hf.export import ExportError, export_hf
from tierzero.engine.hf.lora import LoraError, apply_lora, peft_aliases

__all__ = ["ExportError", "LoraError", "apply_lora", "export_hf", "peft_aliases"]
