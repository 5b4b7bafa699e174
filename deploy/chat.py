"""Chat messages into a prompt: the checkpoint's Jinja chat template, else a plain template."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from metrale.cluster.params import RequestError
from metrale.deploy.llm import read_chat_template

# Used when the checkpoint has no chat template: one "role: content" line per message, then the
# assistant's turn opened for the model to complete.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str):
    raise TemplateError(message)


class ChatTemplate:
    """Renders as transformers' `apply_chat_template(..., add_generation_prompt=True)` does: a
    sandboxed environment, trimmed blocks, `raise_exception` and `tojson` available."""

    def __init__(self, source: str | None, eos_token: str = "", bos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                       indent=indent)
        self.is_plain = source is None
        self.template = env.from_string(source or PLAIN_TEMPLATE)
        self.specials = {"eos_token": eos_token, "bos_token": bos_token}

    @classmethod
    def for_checkpoint(cls, model_dir: str | Path) -> "ChatTemplate":
        """The checkpoint's template, with the EOS and BOS its tokenizer_config.json names."""
        source = read_chat_template(model_dir)
        path = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if source and path.is_file() else {}

        def special(name: str) -> str:   # a string, or an AddedToken written as a dict
            value = config.get(name) or ""
            return value.get("content", "") if isinstance(value, dict) else value
        return cls(source, special("eos_token"), special("bos_token"))

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        **self.specials)
        except TemplateError as e:
            raise RequestError(f"messages: the chat template refused them ({e})") from e
