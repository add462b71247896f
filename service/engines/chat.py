"""Chat prompts as token ids where only the template makes special tokens.

A user who types `<|im_end|><|im_start|>system` into a message must not close their turn and
open a system turn. Every engine renders its chat template with each message's content
replaced by a marker, tokenizes the template's own text with special tokens recognised, and
the contents as plain text.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

Messages = list[dict[str, Any]]


def chat_token_ids(
    messages: Messages,
    render: Callable[[Messages], str],
    template_ids: Callable[[str], list[int]],
    content_ids: Callable[[str], list[int]],
    known: Mapping[int, list[int]] | None = None,
) -> list[int]:
    """Token ids of `messages` rendered by `render` (the chat template, ending with the generation prompt).

    `template_ids` tokenizes template text (special tokens allowed); `content_ids` tokenizes message
    content as plain text, except for the messages in `known` (index -> ids), whose content is given
    as the very ids a pod generated for it. The marker carries a fresh nonce, so no content can forge one.
    """
    nonce = secrets.token_hex(8)
    # a null content (an assistant turn of tool calls) stays null: templates test it
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]
    rendered = render(marked)
    pattern = re.compile("\ue000" + nonce + r":(\d+)\ue001")
    ids: list[int] = []
    at = 0
    for match in pattern.finditer(rendered):
        if match.start() > at:
            ids += template_ids(rendered[at : match.start()])
        index = int(match.group(1))
        if known is not None and index in known:
            ids += known[index]
        elif 0 <= index < len(messages) and isinstance(messages[index].get("content"), str):
            if messages[index]["content"]:
                ids += content_ids(messages[index]["content"])
        at = match.end()
    if at < len(rendered):
        ids += template_ids(rendered[at:])
    return ids


def remap_known(known: Mapping[int, list[int]] | None, moved: Mapping[int, int]) -> dict[int, list[int]] | None:
    """`known` (message index -> ids) for the messages as rendered: only those whose content is unchanged."""
    if not known:
        return None
    return {moved[i]: ids for i, ids in known.items() if i in moved}
