"""Protobuf <-> typed values, shared by the router and the workers.

The generated ``protos`` package sits below everything (it imports nothing of ours), so
this bottom-layer module may use it. Conversion validates: a bad value raises
:class:`~common.sampling.InvalidRequestError` naming the field.
"""

from __future__ import annotations

from protos.pdserve.v1 import common_pb2, worker_pb2

from .request import Request
from .sampling import InvalidRequestError, SamplingParams, StructuredOutput

MAX_MESSAGE_BYTES = 8 * 2**20
"""The largest gRPC message any pdserve endpoint sends or receives: the router's public
server, its channels to the workers, the workers' servers, and the HTTP front's body
limit. One number, so a request the router accepts is never refused further in."""

KEEPALIVE_CHANNEL = (("grpc.keepalive_time_ms", 2000), ("grpc.keepalive_timeout_ms", 3000),
                     ("grpc.keepalive_permit_without_calls", 1),
                     ("grpc.http2.max_pings_without_data", 0))
"""The router's channels to the workers ping every 2 s and give up after 3 s without
an answer: a worker whose node died without closing its connections (power, a cut link:
no FIN, no RST) fails its streams within ~5 s, and the router migrates them, instead of
waiting on a peer that will never speak (TCP alone would wait forever on an idle
stream)."""

KEEPALIVE_SERVER = (("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000),
                    ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                    ("grpc.http2.max_ping_strikes", 0))
"""The workers' servers accept the router's pings (at most one a second counts as
polite) and ping it themselves every 10 s: a request whose router vanished is
cancelled, and its blocks freed, within ~15 s."""

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_NAMES = {v: k for k, v in FINISH_REASONS.items()}

_KINDS = {
    "json_object": common_pb2.StructuredOutput.KIND_JSON_OBJECT,
    "json_schema": common_pb2.StructuredOutput.KIND_JSON_SCHEMA,
    "regex": common_pb2.StructuredOutput.KIND_REGEX,
    "choice": common_pb2.StructuredOutput.KIND_CHOICE,
    "grammar": common_pb2.StructuredOutput.KIND_GRAMMAR,
}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs",
             "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens")


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine defaults."""
    kwargs: dict[str, object] = {
        name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)
    }
    return SamplingParams(
        stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias), allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words=tuple(msg.bad_words),
        structured=_structured_from_proto(msg.structured) if msg.HasField("structured")
        else None,
        **kwargs,  # type: ignore[arg-type]
    )


def _structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    kind = _KIND_NAMES.get(msg.kind)
    if kind is None:
        raise InvalidRequestError(
            "structured", f"kind must be one of {', '.join(_KINDS)}, got enum value {msg.kind}")
    return StructuredOutput(kind, msg.spec, msg.prior_tokens)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        min_p=p.min_p, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=dict(p.logit_bias), allowed_token_ids=list(p.allowed_token_ids),
        bad_words=list(p.bad_words),
    )
    # Off values stay unset: the message of a plain request does not grow.
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.frequency_penalty != 0.0:
        msg.frequency_penalty = p.frequency_penalty
    if p.presence_penalty != 0.0:
        msg.presence_penalty = p.presence_penalty
    if p.min_tokens:
        msg.min_tokens = p.min_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.structured is not None:
        msg.structured.CopyFrom(common_pb2.StructuredOutput(
            kind=_KINDS[p.structured.kind], spec=p.structured.spec,
            prior_tokens=p.structured.prior_tokens))
    return msg


def request_to_proto(r: Request) -> worker_pb2.WorkerGenerateRequest:
    """The internal API's form of a request (router -> worker)."""
    return worker_pb2.WorkerGenerateRequest(
        request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
        sampling=sampling_to_proto(r.sampling), cache_salt=r.cache_salt or "",
        n=r.n if r.n != 1 else 0, prompt_logprobs=r.prompt_logprobs)


def request_from_proto(msg: worker_pb2.WorkerGenerateRequest) -> Request:
    """A worker's typed request; raises ``InvalidRequestError`` naming the field."""
    return Request(msg.request_id, tuple(msg.prompt_token_ids),
                   sampling_from_proto(msg.sampling), msg.cache_salt or None, msg.n or 1,
                   msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)
