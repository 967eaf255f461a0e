"""What the router's edge bounds before it spends any work on a request.

Both fronts end in :meth:`router.core.Router.validate`; before tokenizing, it checks
here, cheaply, that the prompt is worth tokenizing: text of at most
:data:`MAX_PROMPT_BYTES` bytes of UTF-8, at most :data:`MAX_CHAT_MESSAGES` chat messages
of at most :data:`MAX_CHAT_BYTES` in all, a client request id of at most
:data:`MAX_CLIENT_REQUEST_ID_CHARS` printable characters. Each refusal is
INVALID_ARGUMENT naming the field and the limit. (The token count is checked against
the context after tokenizing; a body or message is already bounded by
:data:`common.wire.MAX_MESSAGE_BYTES`.)

Text that is no Unicode (a lone surrogate from a JSON ``"\\ud800"`` escape, bytes that
are not UTF-8 in a gRPC message) is refused the same way: the HTTP front checks the
decoded JSON (:func:`unencodable_path`), the gRPC server the message bytes when
protobuf refuses them (:func:`bad_utf8_field`, which finds the field protobuf's error
does not name).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from .errors import RouterError

MAX_PROMPT_BYTES = 2 * 2**20
"""A text prompt's bound, checked before tokenizing it. At about 4 bytes a token, 2 MiB
is some 500 K tokens, past the context of any model served here, and tokenizing it
takes well under a second on one core (on the tokenizer's thread, off the event loop)."""

MAX_CHAT_MESSAGES = 1024
"""Chat messages per request: more turns than any context holds; each is a template
iteration."""

MAX_CHAT_BYTES = MAX_PROMPT_BYTES
"""Roles and contents of all chat messages together, in bytes of UTF-8: what the chat
template renders and the tokenizer then reads."""

MAX_CLIENT_REQUEST_ID_CHARS = 256
"""A client's own request id: it names log lines and the worker calls derived from it
(which append a suffix), so it is short and printable."""


def _invalid(field: str, message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", field)


def utf8_size(field: str, text: str, limit: int) -> int:
    """``text``'s size in bytes of UTF-8; INVALID_ARGUMENT naming ``field`` when it is
    over ``limit`` or is no Unicode (a lone surrogate)."""
    if len(text) > limit:  # every character is at least a byte: no need to encode
        raise _invalid(field, f"{len(text)} characters is over the limit of {limit} bytes")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise _invalid(field, f"not valid Unicode text: {e.reason} at character "
                              f"{e.start}") from None
    if size > limit:
        raise _invalid(field, f"{size} bytes of UTF-8 is over the limit of {limit} bytes")
    return size


def check_text_prompt(text: str) -> None:
    utf8_size("prompt", text, MAX_PROMPT_BYTES)


def check_chat(messages: list[dict[str, str]]) -> None:
    """Count and total size of chat messages (their roles are checked by the router)."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise _invalid("messages", f"{len(messages)} messages is over the limit of "
                                   f"{MAX_CHAT_MESSAGES}")
    too_big = _invalid("messages", "the roles and contents of the messages are over the "
                                   f"limit of {MAX_CHAT_BYTES} bytes of UTF-8 in all")
    if sum(len(m["role"]) + len(m["content"]) for m in messages) > MAX_CHAT_BYTES:
        raise too_big  # characters <= bytes: no need to encode
    total = 0
    for i, m in enumerate(messages):
        for part in ("role", "content"):
            total += utf8_size(f"messages[{i}].{part}", m[part], MAX_CHAT_BYTES)
    if total > MAX_CHAT_BYTES:
        raise too_big


def check_request_id(request_id: str) -> None:
    """A client's request id: short and printable (it lands in log lines)."""
    if len(request_id) > MAX_CLIENT_REQUEST_ID_CHARS:
        raise _invalid("request_id", f"{len(request_id)} characters is over the limit of "
                                     f"{MAX_CLIENT_REQUEST_ID_CHARS}")
    if not request_id.isprintable():
        raise _invalid("request_id", "must be printable characters (no control characters "
                                     "or line breaks)")


# --------------------------------------------------------------------------- decoded JSON


def unencodable_path(value: Any) -> str | None:
    """The path (``messages[0].content``) of the first string in a decoded JSON value,
    key or value, that does not encode as UTF-8; None when every one does. Iterative:
    a nesting depth ``json.loads`` accepted must not overflow the stack here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not _encodes(v):
                return path or "body"
        elif isinstance(v, dict):
            items: Iterable[tuple[str, Any]] = v.items()
            for k, child in reversed(list(items)):
                if not _encodes(k):
                    return f"{path}.<key>" if path else "<key>"
                stack.append((f"{path}.{k}" if path else k, child))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(v))))
    return None


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --------------------------------------------------------------------------- protobuf bytes


def bad_utf8_field(data: bytes, descriptor: Descriptor) -> str | None:
    """The path (``messages.messages[2].content``) of the first string field of the
    serialized message ``data`` (of type ``descriptor``) that is not valid UTF-8; None when
    there is none or the bytes are no message at all. Only for naming the field after
    protobuf refused the bytes: it walks the wire format, microseconds per field."""
    try:
        return _walk(memoryview(data), descriptor, "")
    except (ValueError, IndexError):
        return None


def _varint(data: memoryview, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _walk(data: memoryview, descriptor: Descriptor, prefix: str) -> str | None:
    i, seen = 0, {}
    while i < len(data):
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, i = _varint(data, i)
            continue
        if wire_type in (1, 5):
            i += 8 if wire_type == 1 else 4
            continue
        if wire_type != 2:
            raise ValueError("groups are not used by pdserve's protos")
        size, i = _varint(data, i)
        if i + size > len(data):
            raise ValueError("truncated")
        chunk, i = data[i:i + size], i + size
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        name = prefix + field.name
        if field.is_repeated:
            seen[number] = seen.get(number, -1) + 1
            name += f"[{seen[number]}]"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                bytes(chunk).decode("utf-8")
            except UnicodeDecodeError:
                return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _walk(chunk, field.message_type, name + ".")
            if found is not None:
                return found
    return None
