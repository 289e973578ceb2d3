"""Models shipped with tierzero: the byte-level causal LM `tierzero train` uses by default."""

from tierzero.engine.models.tiny_lm import SIZES, VOCAB, Block, LMOutput, TinyLM, TinyLMConfig

__all__ = ["SIZES", "VOCAB", "Block", "LMOutput", "TinyLM", "TinyLMConfig"]
