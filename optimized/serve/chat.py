"""Chat messages to prompt text: the checkpoint's chat template, or nanoverify's own (SERVE-10).

Invariant: a checkpoint whose ``tokenizer_config.json`` has a ``chat_template``
(a Jinja string, or a list of named ones: "default" is used) is rendered with
it, in a sandboxed Jinja environment as transformers does, with ``messages``,
``add_generation_prompt=True``, ``bos_token`` and ``eos_token``. Any other
checkpoint, the embedded default model among them, gets ``DEFAULT_TEMPLATE``:
each message as ``<|role|>`` on a line of its own, then its content and a
newline; then ``<|assistant|>`` and a newline, where the answer begins. A
template that fails to render is a ValueError (the request's 400).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an object with its ``content``."""
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    return content if isinstance(content, str) else ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"chat_template does not compile: {e}") from None
        self.source = source
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[dict[str, str]]) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._tokens)
        except (TemplateError, ValueError, TypeError) as e:
            raise ValueError(f"messages: the chat template refused them: {e}") from None


def _raise(message: str) -> None:
    raise ValueError(message)


def load_chat_template(model_dir: Path) -> ChatTemplate:
    """The checkpoint's template when its tokenizer_config.json has one, else ``DEFAULT_TEMPLATE``."""
    path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not readable JSON ({e})") from None
        config = loaded if isinstance(loaded, dict) else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        source = DEFAULT_TEMPLATE
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
