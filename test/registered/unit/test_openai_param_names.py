"""The OpenAI routes name their own fields in errors raised by the shared request path
(serving_base.openai_param_names): the `param` and the snake_case names in the message."""

from __future__ import annotations

import pytest

from sglang.srt.entrypoints.openai.serving_base import openai_param_names
from sglang.srt.entrypoints.openai.serving_completions import COMPLETION_PARAMS
from sglang.srt.managers.generate_request import InvalidRequestError


def raised(error: InvalidRequestError) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        with openai_param_names(COMPLETION_PARAMS):
            raise error
    return info.value


def test_the_shared_path_s_names_become_the_route_s():
    e = raised(InvalidRequestError("min_new_tokens (9) must not exceed max_new_tokens (8)", param="min_new_tokens"))
    assert e.param == "min_tokens" and e.message == "min_tokens (9) must not exceed max_tokens (8)"
    assert str(e) == e.message
    # Only whole snake_case names: `text` is a word, and max_new_tokens_x is another name.
    e = raised(InvalidRequestError("the text is long; input_ids and max_new_tokens_x", param="text"))
    assert e.param == "prompt" and e.message == "the text is long; prompt and max_new_tokens_x"


def test_a_route_s_own_error_keeps_its_names():
    message = "min_new_tokens is the name on /generate; the OpenAI routes take min_tokens"
    e = raised(InvalidRequestError(message, param="min_new_tokens", route_terms=True))
    assert e.param == "min_new_tokens" and e.message == message
