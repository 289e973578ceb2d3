"""Tiny tokenizers, models and datasets built in the test (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# BOS, each message as <|role|>content, EOS after a reply; the generation prompt opens
# an assistant turn. Renders turns in order, so prompt masking can cut it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
COLORS = {"apple": "red", "sky": "blue", "grass": "green", "snow": "white", "coal": "black",
          "sun": "yellow", "plum": "purple", "rust": "orange"}


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations with a learnable answer: the color of a thing (some with a system
    message, some with two turns)."""
    things = sorted(COLORS)
    rows = []
    for i in range(n):
        a, b = things[(i + seed) % len(things)], things[(3 * i + 1 + seed) % len(things)]
        messages = [{"role": "user", "content": f"What color is the {a}?"},
                    {"role": "assistant", "content": f"The {a} is {COLORS[a]}."}]
        if i % 3 == 1:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        if i % 4 == 2:
            messages += [{"role": "user", "content": f"And the {b}?"},
                         {"role": "assistant", "content": f"The {b} is {COLORS[b]}."}]
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_tokenizer(directory: Path, *, chat_template: bool = True) -> Any:
    """A byte-level BPE of ~300 tokens trained here, saved as a transformers fast tokenizer."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for r in chat_rows(64) for m in r["messages"]]
    bpe.train_from_iterator(corpus * 4, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>")
    if chat_template:
        tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return tok


def tiny_llama(directory: Path, vocab: int, *, seed: int = 0) -> Any:
    """A 2-layer Llama with `vocab` tokens, saved with save_pretrained (safetensors)."""
    import torch
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(directory)
    return model


def pretrained_dir(directory: Path) -> tuple[Path, Any]:
    """A model directory as people download them: config, weights and tokenizer files."""
    tok = tiny_tokenizer(directory)
    tiny_llama(directory, len(tok))
    return directory, tok
