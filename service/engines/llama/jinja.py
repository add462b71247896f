"""Render a GGUF's chat template (Jinja) the way transformers' apply_chat_template does, sandboxed."""

from __future__ import annotations

import functools
import json
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cachestore.errors import ConfigError


def _raise(message: str) -> None:
    raise TemplateError(message)


@functools.cache
def _compiled(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], *, bos: str = "", eos: str = "",
                tools: list[dict[str, Any]] | None = None) -> str:
    """The template's text for `messages` (and `tools`, as transformers hands them), ending with the assistant
    generation prompt."""
    try:
        return str(_compiled(template).render(messages=messages, add_generation_prompt=True,
                                              bos_token=bos, eos_token=eos, tools=tools))
    except TemplateError as exc:
        raise ConfigError(f"the model's chat template failed: {exc}") from None
