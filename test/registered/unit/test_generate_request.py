"""Normalisation of native generate requests (managers/generate_request.py)."""

from __future__ import annotations

import pytest

from sglang.srt.managers.generate_request import GenerateReqInput, InvalidRequestError
from sglang.srt.sampling.sampling_params import SamplingParams


def test_single_and_batch() -> None:
    reqs, is_batch = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 3}).normalize()
    assert not is_batch and len(reqs) == 1 and reqs[0].text == "hi"
    reqs, is_batch = GenerateReqInput(input_ids=[[1, 2], [3]], lora_path=["a", None],
                                      return_logprob=[True, False]).normalize()
    assert is_batch and [r.input_ids for r in reqs] == [[1, 2], [3]]
    assert [r.lora_name for r in reqs] == ["a", None] and [r.return_logprob for r in reqs] == [True, False]


def test_n_expands_with_distinct_seeds() -> None:
    reqs, is_batch = GenerateReqInput(text="hi", sampling_params={"n": 3, "seed": 7}, rid="x").normalize()
    assert is_batch and [r.rid for r in reqs] == ["x-0", "x-1", "x-2"]
    assert [r.sampling_params["seed"] for r in reqs] == [7, 8, 9]
    assert all("n" not in r.sampling_params for r in reqs)


def test_n_seeds_near_the_int64_edge_wrap_and_stay_valid() -> None:
    """Sample j draws with seed + j wrapped into int64: 2**63 - 1 with n = 2 was refused, naming a
    seed (2**63) the client never sent."""
    top = 2**63 - 1
    reqs, _ = GenerateReqInput(text="hi", sampling_params={"n": 3, "seed": top - 1}).normalize()
    seeds = [r.sampling_params["seed"] for r in reqs]
    assert seeds == [top - 1, top, -(2**63)]
    for r in reqs:
        SamplingParams.from_dict(r.sampling_params)  # each sample's params pass validation


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(), "text"),
        (dict(text="a", input_ids=[1]), "text"),
        (dict(text=["a", "b"], lora_path=["x"]), "lora_path"),
        (dict(text=5), "text"),
        (dict(input_ids=[]), "input_ids"),
        (dict(input_ids=[1, "2"]), "input_ids"),
        (dict(text="a", logprob_start_len=-2), "logprob_start_len"),
        (dict(text=["a", "b"], rid=["same", "same"]), "rid"),
        (dict(text="a", stream="yes"), "stream"),
        (dict(text="a", sampling_params={"n": 0}), "n"),
    ],
)
def test_bad_requests_name_the_field(kwargs, param) -> None:
    with pytest.raises(InvalidRequestError) as e:
        GenerateReqInput(**kwargs).normalize()
    assert e.value.param == param


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="unknown field"):
        GenerateReqInput.from_json({"text": "a", "max_tokens": 3})
