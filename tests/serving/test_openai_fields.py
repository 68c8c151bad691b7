"""Every field of the OpenAI request models is read or refused, never dropped (no processes): a wrong-typed value of
any declared field is an error naming it, and a field a request model does not declare is refused, not ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.balancer.http_errors import api_error
from services.balancer.openai_protocol import ChatCompletionRequest, CompletionRequest

BASE = {ChatCompletionRequest: {"messages": [{"role": "user", "content": "hi"}]}, CompletionRequest: {"prompt": "x"}}
WRONG = object()  # a value no declared field takes (no JSON value is one)


def refusal(model: type, body: dict) -> tuple[str | None, str]:
    """The (param, code) of the HTTP error for ``body`` (validated, then mapped to the wire)."""
    try:
        req = model.model_validate(body)
        req.to_proto("r") if model is CompletionRequest else req.to_proto("r", 64)
    except (ValidationError, ValueError) as e:
        err = api_error(e)
        return err.param, err.code
    return None, "accepted"


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest], ids=["chat", "completions"])
def test_a_wrong_typed_value_of_any_field_is_refused_naming_it(model: type) -> None:
    for name in model.model_fields:
        param, code = refusal(model, {**BASE[model], name: WRONG})
        assert param is not None and param.split(".")[0].split("[")[0] == name, (name, param, code)


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest], ids=["chat", "completions"])
def test_a_field_the_endpoint_does_not_declare_is_refused(model: type) -> None:
    other = ChatCompletionRequest if model is CompletionRequest else CompletionRequest
    undeclared = [n for n in other.model_fields if n not in model.model_fields]
    undeclared += ["frobnicate", "use_beam_search", "spaces_between_special_tokens", "add_generation_prompt"]
    assert len(undeclared) > 4
    for name in undeclared:
        assert refusal(model, {**BASE[model], name: 1}) == (name, "unknown_parameter"), name


def test_fields_that_change_nothing_generated_are_accepted() -> None:
    body = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "default", "safety_identifier": "s",
            "prompt_cache_key": "p"}  # fmt: skip
    for model in BASE:
        assert refusal(model, {**BASE[model], **body}) == (None, "accepted")
    assert refusal(ChatCompletionRequest, {**BASE[ChatCompletionRequest], "modalities": ["text"]})[1] == "accepted"
