"""Chat messages -> prompt token ids.

With a chat template (the one given, as `serve --chat-template` gives it; else
tokenizer_config.json's `chat_template`, else a chat_template.jinja file beside it), the messages are rendered with jinja2 in a sandbox as Hugging Face does (messages,
add_generation_prompt=True, bos_token, eos_token) and tokenized without adding special tokens: the
template writes its own. Without one, each message is a line "{role}: {content}\\n", then
"assistant:", tokenized with the tokenizer's special tokens (BOS).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from slora_jax.serve.errors import bad


class ChatFormatter:
    """`tokenizer`: the model's `slora_jax.model.tokenizer.Tokenizer` (its parsed tokenizer.json is
    used as is); `template`: a Jinja source in place of the model directory's."""

    def __init__(self, model_dir: str | None, tokenizer, template: str | None = None):
        self.tokenizer = tokenizer
        self.template = None
        self.special: dict[str, str] = {}
        if tokenizer is None:
            if template is not None:
                raise ValueError("--chat-template: this model has no tokenizer.json, so it cannot chat")
            return
        cfg_file = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
        conf = json.loads(cfg_file.read_text()) if cfg_file is not None and cfg_file.is_file() else {}
        tmpl = template or conf.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        jinja_file = Path(model_dir) / "chat_template.jinja" if model_dir is not None else None
        if not tmpl and jinja_file is not None and jinja_file.is_file():  # where newer checkpoints (Qwen3) keep it
            tmpl = jinja_file.read_text()
        if not tmpl:
            return
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = conf.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                self.special[key] = v
        self.template = self.compile_template(tmpl)

    @staticmethod
    def compile_template(source: str):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        return env.from_string(source)

    def render(self, messages: list[dict]) -> str:
        if self.template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except jinja2.TemplateError as e:
            raise bad(f"the chat template refused these messages: {e}", "messages") from None

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.render(messages)
        if self.template is None:
            return self.tokenizer.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False)
