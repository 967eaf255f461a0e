"""The OpenAI-compatible HTTP front of the router (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``).

This package only translates: OpenAI JSON in, one :class:`api_pb2.GenerateRequest` to the
router, the router's :class:`api_pb2.GenerateResponse` stream back out as OpenAI JSON or
server-sent events. Everything about *values* (temperature >= 0, the prompt fits the
context, the model is loaded, there is room for one more request) is the router's call; it
raises :class:`RouterError` and the same error reaches the client with
:func:`router.errors.http_status` of its gRPC code, so both APIs say the same thing.

One request's lifecycle, and the module that owns each step (each module's docstring has
the details):

1. **Body** (:mod:`.app`): read within ``max_body_bytes`` (413 otherwise).
2. **Parse** (:mod:`.protocol`): the body is a JSON object; each known field is type-checked,
   unsupported features are refused unless neutral, unknown fields are ignored.
3. **Translate** (:mod:`.protocol`): one ``GenerateRequest``.
4. **Drive** (:mod:`.app`): ``router.generate``, watched for the client going away.
5. **Answer** (:mod:`.render` shapes the OpenAI objects and SSE chunks, choice by choice;
   :mod:`.responses` the SSE framing and error bodies; :mod:`.app` sends them).
6. **Cleanup** (:mod:`.app`): the router generator is closed however the request ends.

``/v1/responses`` (OpenAI's Responses API, the subset for text models) is a translation
onto the chat path (:mod:`.responses_api`): its body becomes a chat body that
:mod:`.protocol` parses as usual, and the chat renderer's chunks become Responses output
items and events; steps 1, 4 and 6 are the same code as the other routes'.

Imports go one way: ``app`` -> ``responses_events`` -> ``responses_api`` -> ``render`` ->
``responses`` ->
``protocol`` -> ``structured``, ``tool_parsers`` -> ``tools`` (tool calling: :mod:`.tools`
has the request side and the flow, :mod:`.tool_parsers` the named prompt/grammar/output
formats).
"""

from .app import create_app

__all__ = ["create_app"]
