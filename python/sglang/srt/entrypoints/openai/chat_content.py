"""A chat message's `content` as the model's chat template wants it.

OpenAI clients may send a message's content as a list of parts (`[{"type": "text", "text": ...}]`).
Chat templates come in two kinds, and SGLang tells them apart by reading the template:

  * "openai": the template loops over `message.content` itself (Llama 3's, Qwen2-VL's): it gets the
    list of text parts and renders them its own way;
  * "string": the template adds `message.content` to its output as text (most others): the parts'
    texts are joined with a space, as SGLang does (vLLM joins with a newline).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal, Optional

import jinja2
from jinja2 import nodes

logger = logging.getLogger(__name__)

ContentFormat = Literal["string", "openai"]

# The names templates give the loop variable over `messages`.
_MESSAGE_NAMES = ("message", "msg", "m")


def _is_message_content(node: Any) -> bool:
    """`message.content` or `message['content']`, also behind filters (`message.content | list`)."""
    while isinstance(node, nodes.Filter):
        node = node.node
    if isinstance(node, nodes.Getattr):
        field, owner = node.attr, node.node
    elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        field, owner = node.arg.value, node.node
    else:
        return False
    return field == "content" and isinstance(owner, nodes.Name) and owner.name in _MESSAGE_NAMES


@functools.lru_cache(maxsize=16)
def _format_of(template: str) -> ContentFormat:
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:  # the tokenizer reports it when the template is used
        logger.debug("Chat template does not parse (%s): content parts are joined as text", e)
        return "string"
    return "openai" if any(_is_message_content(loop.iter) for loop in tree.find_all(nodes.For)) else "string"


def template_content_format(template: Optional[Any]) -> ContentFormat:
    """How the chat template takes a message's content (see the module docstring). A tokenizer may
    hold several named templates: the default one decides."""
    if isinstance(template, dict):
        template = template.get("default")
    return _format_of(template) if isinstance(template, str) else "string"


def content_for_template(texts: list[str], fmt: ContentFormat) -> str | list[dict[str, str]]:
    """A message's text parts in the form its template takes."""
    if fmt == "openai":
        return [{"type": "text", "text": t} for t in texts]
    return " ".join(texts)


def content_chars(content: Any) -> int:
    """Characters of a message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0
