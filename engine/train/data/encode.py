"""Rows -> token ids with a per-token "is a target" flag (the loss mask).

A row is one of (its keys decide; extra keys are ignored):
- text:              {"text": str}                      every token is a target
- prompt/completion: {"prompt": str, "completion": str} only the completion (and
                                                         the end token) are targets
- chat:              {"messages": [{"role", "content"}, ...]}
                     only the assistant turns' replies (and what the template
                     closes them with) are targets.

Chat with a template ([Note: chat prompt masking]): for each assistant turn i
the template renders messages[:i] with the generation prompt (the prompt the
model continues) and messages[:i + 1] (the prompt plus its reply); the reply
is the difference. Each rendering must begin with the previous one, or the
template is refused with the row named. The rendered text is tokenised whole,
without added special tokens (the template writes its own), and a token is a
target when it starts inside a reply (a fast tokenizer's character offsets; a
slow one tokenises segment by segment). Without a template (byte-level, or a
tokenizer without one) each message is written `role: content` on its own
line, the reply followed by the end token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tierzero.engine.train.data.errors import DataError
from tierzero.engine.train.data.rows import Row
from tierzero.engine.train.data.tokenizer import Message, Tokenizer

KINDS = ("text", "prompt/completion", "chat")


@dataclass(frozen=True)
class Example:
    ids: list[int]
    target: list[bool]  # per token: does the loss predict it


def kind_of(row: Row) -> str:
    data = row.data
    if "messages" in data:
        return "chat"
    if "prompt" in data or "completion" in data:
        return "prompt/completion"
    if "text" in data:
        return "text"
    raise DataError(f"{row.where}: needs a string field 'text', string fields 'prompt' and "
                    "'completion', or a list 'messages' of {role, content}; found keys "
                    f"{sorted(data)}")


def encode(row: Row, tok: Tokenizer) -> Example:
    kind = kind_of(row)
    if kind == "text":
        doc = tok.encode(_string(row, "text"), specials=True) + tok.end
        return Example(doc, [True] * len(doc))
    if kind == "prompt/completion":
        prompt, completion = _string(row, "prompt"), _string(row, "completion")
        ids, target = tok.encode_segments([(prompt, False), (completion, True)], specials=True)
        return Example(ids + tok.end, target + [True] * len(tok.end))
    messages = _messages(row)
    if tok.has_chat_template:
        ids, target = tok.encode_segments(_template_segments(row, messages, tok),
                                          specials=False)
    else:
        ids, target = tok.encode_segments(_plain_segments(messages), specials=False)
        ids, target = ids + tok.end, target + [True] * len(tok.end)
    if not any(target):
        raise DataError(f"{row.where}: the assistant replies encode to no tokens; nothing to "
                        "train on")
    return Example(ids, target)


def _string(row: Row, key: str) -> str:
    value = row.data.get(key)
    if not isinstance(value, str):
        raise DataError(f"{row.where}: field '{key}' is {type(value).__name__} {value!r:.60}; "
                        "allowed: a string")
    return value


def _messages(row: Row) -> list[Message]:
    raw = row.data["messages"]
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        raise DataError(f"{row.where}: 'messages' is {type(raw).__name__}; allowed: a non-empty "
                        "list of {role, content} objects")
    out: list[Message] = []
    for i, m in enumerate(raw):
        if (not isinstance(m, Mapping) or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)):
            raise DataError(f"{row.where}: messages[{i}] is {m!r:.80}; allowed: an object with "
                            "string 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{row.where}: no message with role 'assistant'; nothing to train on "
                        f"(roles: {[m['role'] for m in out]})")
    return out


def _plain_segments(messages: list[Message]) -> list[tuple[str, bool]]:
    segments: list[tuple[str, bool]] = []
    for m in messages:
        if m["role"] == "assistant":
            segments += [("assistant: ", False), (m["content"] + "\n", True)]
        else:
            segments.append((f"{m['role']}: {m['content']}\n", False))
    return segments


def _template_segments(row: Row, messages: list[Message],
                       tok: Tokenizer) -> list[tuple[str, bool]]:
    # [Note: chat prompt masking] (module doc)
    segments: list[tuple[str, bool]] = []
    done = ""  # the text rendered so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(row, tok, messages[:i], generation_prompt=True)
        full = _render(row, tok, messages[: i + 1], generation_prompt=False)
        _check_prefix(row, done, prompt, i)
        _check_prefix(row, prompt, full, i)
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    whole = _render(row, tok, messages, generation_prompt=False)
    _check_prefix(row, done, whole, len(messages) - 1)
    segments.append((whole[len(done):], False))
    return segments


def _render(row: Row, tok: Tokenizer, messages: list[Message], *,
            generation_prompt: bool) -> str:
    if not messages:
        return ""
    try:
        return tok.render_chat(messages, generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2 errors from the template itself
        raise DataError(f"{row.where}: the chat template of {tok.name} fails on this row "
                        f"({type(exc).__name__}: {exc})") from exc


def _check_prefix(row: Row, head: str, text: str, index: int) -> None:
    if not text.startswith(head):
        raise DataError(f"{row.where}: the chat template of this tokenizer renders messages "
                        f"up to [{index}] so that the earlier turns are not a prefix of it; "
                        "prompt tokens cannot be masked. Use a template that renders turns "
                        "in order, or prompt/completion rows")


def encode_all(rows: Sequence[Row], tok: Tokenizer) -> list[Example]:
    return [encode(r, tok) for r in rows]


def describe_kinds(rows: Sequence[Row]) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys(KINDS, 0)
    for r in rows:
        counts[kind_of(r)] += 1
    return {k: n for k, n in counts.items() if n}


def all_text(rows: Sequence[Row]) -> bool:
    return all(kind_of(r) == "text" for r in rows)
