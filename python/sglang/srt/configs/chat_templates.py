"""`--chat-template`: a Jinja chat template from a file, or one of a few built-in names.

The template replaces the tokenizer's own for /v1/chat/completions (rendered by the tokenizer's
`apply_chat_template`, so it sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token`
and the request's `chat_template_kwargs`). The built-ins are the three layouts most checkpoints
use; a checkpoint with its own template needs none of them.
"""

from __future__ import annotations

import os
from typing import Optional

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    # Qwen, and many fine-tunes: <|im_start|>role\ncontent<|im_end|>\n
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama 3 / 3.1 instruct: header tokens around each role, <|eot_id|> after each turn.
    "llama-3-instruct": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
        "+ '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    # Mistral instruct: [INST] user [/INST] assistant</s>; a system message joins the first user turn.
    "mistral": (
        "{{ bos_token }}"
        "{% set ns = namespace(system='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
        "{% elif message['role'] == 'user' %}{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
        "{% set ns.system = '' %}"
        "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}


def _check_syntax(name: str, text: str) -> None:
    """A template that does not parse is the server's misconfiguration: refuse it at start, not
    with a 400 on every chat request."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template file {name!r}: line {e.lineno}: {e.message}") from None


def resolve_chat_template(value: Optional[str]) -> Optional[str]:
    """The template text of `--chat-template` (None: keep the tokenizer's); ValueError if it names
    neither a readable file nor a built-in."""
    if value is None:
        return None
    if value in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[value]
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise ValueError(f"--chat-template file {value!r} is empty")
        _check_syntax(value, text)
        return text
    raise ValueError(
        f"--chat-template {value!r} is neither a file nor a built-in template; built-ins: "
        f"{', '.join(sorted(BUILTIN_CHAT_TEMPLATES))}"
    )
