"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: parsing the bodies.

``/tokenize`` takes ``{"model"?, "prompt": str, "add_special_tokens"?: bool (true)}`` or
``{"model"?, "messages": [...], "add_generation_prompt"?: true}`` (rendered by the model's
chat template, as a chat completion would be) and answers ``{"tokens", "count",
"max_model_len"}``; ``/detokenize`` takes ``{"model"?, "tokens": [ids]}`` and answers
``{"prompt"}``. The router does the work on its tokenizer thread (:meth:`router.core.
Router.encode_as`, ``tokenize_as``, ``detokenize_as``); a bad field is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from protos.pdserve.v1 import api_pb2
from router.auth import Principal

from .protocol import UINT32_MAX, Fields, bad, chat_messages, check_model, describe


@runtime_checkable
class TokenizingRouter(Protocol):
    """What the two routes need from the router core (a stand-in router without these
    methods serves neither route)."""

    async def tokenize_as(self, req: api_pb2.TokenizeRequest,
                          caller: Principal | None = None) -> list[int]: ...

    async def encode_as(self, text: str, add_special_tokens: bool,
                        caller: Principal | None = None) -> list[int]: ...

    async def detokenize_as(self, ids: list[int], caller: Principal | None = None
                            ) -> str: ...


@dataclass(frozen=True)
class TokenizeCall:
    text: str | None
    """The prompt (None: ``messages``)."""
    messages: api_pb2.ChatMessages | None
    add_special_tokens: bool


def parse_tokenize(body: dict[str, Any], served: str) -> TokenizeCall:
    """The ``/tokenize`` body; raises RouterError naming the field."""
    f = Fields(body)
    check_model(f, served)
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "send one of prompt (a string) or messages (a list of "
                             "{role, content} objects)")
    if "messages" in body:
        if f.bool_("add_special_tokens"):
            raise bad("add_special_tokens", "add_special_tokens: with messages the chat "
                                             "template places the special tokens; send false "
                                             "or leave it out")
        if f.bool_("add_generation_prompt") is False:
            raise bad("add_generation_prompt", "add_generation_prompt: only true (the "
                                                "default) is supported")
        return TokenizeCall(None, chat_messages(f.get("messages")), False)
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise bad("prompt", f"prompt must be a string, got {describe(prompt)}")
    add = f.bool_("add_special_tokens")
    return TokenizeCall(prompt, None, True if add is None else add)


def parse_detokenize(body: dict[str, Any], served: str) -> list[int]:
    """The ``/detokenize`` body's ids (the router checks them against its vocabulary);
    raises RouterError naming the field."""
    f = Fields(body)
    check_model(f, served)
    if body.get("tokens") is None:
        raise bad("tokens", "tokens is required: a list of token ids")
    return f.int_list("tokens", 0, UINT32_MAX)
