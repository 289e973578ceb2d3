"""Tiny Hugging Face models and tokenizers built in the test (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 300  # >= 256: `tierzero train`'s byte-level data fits any such model


def llama_config(vocab: int = VOCAB, tie: bool = False) -> Any:
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64,
        tie_word_embeddings=tie)


def save_tiny_llama(path: Path, *, seed: int = 0, vocab: int = VOCAB, tie: bool = False,
                    tokenizer: bool = True) -> Path:
    """A tiny pretrained Llama directory (config.json, model.safetensors) and, with
    `tokenizer`, a word-level tokenizer's files, as save_pretrained writes them."""
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(llama_config(vocab, tie)).save_pretrained(path)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = {f"w{i}": i + 2 for i in range(vocab - 2)}
        tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, **words}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                    eos_token="</s>")
        fast.save_pretrained(path)
    return path


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # type: ignore[no-any-return]
