"""A chat message's list of text parts reaches the chat template in the form the template takes:
the list itself where the template loops over `message.content`, else the texts joined by a space
(SGLang's rule). Checked on the templates' syntax, and through `chat_prompt_ids` on a real
tokenizer whose template is switched between the two kinds."""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.entrypoints.openai.chat_content import content_chars, template_content_format
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_chat import chat_prompt_ids
from sglang.srt.managers.tokenizer_manager import TokenizerManager

# The text of each message, however its content arrives.
STRING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3's way: a string as it is, a list part by part, each text marked so the test sees the parts.
LOOP_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}{% if part.type == 'text' %}[{{ part.text }}]{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template, fmt", [
    (STRING_TEMPLATE, "string"),
    (LOOP_TEMPLATE, "openai"),
    ("{% for m in messages %}{% for c in m['content'] | selectattr('type', 'eq', 'text') %}{{ c.text }}"
     "{% endfor %}{% endfor %}", "openai"),  # behind a filter, the loop variable named m
    ("{% for message in messages %}{% for tool in message.tool_calls %}{{ tool.name }}{% endfor %}"
     "{{ message.content }}{% endfor %}", "string"),  # a loop over another field
    ("{% for message in messages %}{{ message.content", "string"),  # does not parse
    ({"default": LOOP_TEMPLATE, "tool_use": STRING_TEMPLATE}, "openai"),  # named templates
    (None, "string"),
])
def test_the_template_decides_the_format(template, fmt) -> None:
    assert template_content_format(template) == fmt


def test_content_chars() -> None:
    assert content_chars("four") == 4
    assert content_chars([{"type": "text", "text": "ab"}, {"type": "text", "text": "cde"}]) == 5
    assert content_chars(None) == 0


@pytest.fixture(scope="module")
def tm(offline_tokenizer_manager) -> TokenizerManager:
    return offline_tokenizer_manager


def _rendered(tm: TokenizerManager, template: str, content) -> str:
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": content}])
    saved = tm.tokenizer.chat_template
    tm.tokenizer.chat_template = template
    try:
        return tm.tokenizer.decode(asyncio.run(chat_prompt_ids(tm, req)))
    finally:
        tm.tokenizer.chat_template = saved


PARTS = [{"type": "text", "text": "Say"}, {"type": "text", "text": "something."}]


def test_a_string_template_gets_the_texts_joined_by_a_space(tm) -> None:
    assert _rendered(tm, STRING_TEMPLATE, PARTS) == _rendered(tm, STRING_TEMPLATE, "Say something.")


def test_a_template_that_loops_over_the_content_gets_the_parts(tm) -> None:
    rendered = _rendered(tm, LOOP_TEMPLATE, PARTS)
    assert "[Say][something.]" in rendered, rendered
    assert _rendered(tm, LOOP_TEMPLATE, "Say something.").count("Say something.") == 1
