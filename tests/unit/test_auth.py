"""The trust boundary's pure logic, in milliseconds: the API key file (router/auth.py),
the tenant limiter (router/limits.py, with an injected clock) and the edge's checks on
text and message bytes (router/edge.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from protos.pdserve.v1 import api_pb2
from router.auth import (
    OPEN,
    KeyFileError,
    KeyStore,
    Principal,
    bearer_key,
    parse_keys,
    tenant_salt,
)
from router.edge import bad_utf8_field, unencodable_path
from router.limits import RateLimited, TenantLimiter, TenantLimits

K1 = "sk-acme-0123456789abcdef"
K2 = "sk-ops-fedcba9876543210"
K3 = "sk-big-aaaabbbbccccdddd"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def by_tenant(keys: dict[bytes, Principal]) -> dict[str, Principal]:
    return {p.tenant: p for p in keys.values()}


# -- the key file ---------------------------------------------------------------------------


def test_key_file_lines_give_tenants_admin_rights_and_limit_overrides() -> None:
    keys = parse_keys(f"""
        # comment line
        {K1} acme
        {K2}   ops  admin   # trailing comment
        {K3} bigco max_concurrency=8 tokens_per_minute=200000
    """)
    got = by_tenant(keys)
    assert set(got) == {"acme", "ops", "bigco"}
    assert not got["acme"].admin and got["acme"].limits is None
    assert got["ops"].admin
    assert got["bigco"].limits == TenantLimits(max_concurrency=8, tokens_per_minute=200000)
    assert all(len(p.key_id) == 8 for p in keys.values())


@pytest.mark.parametrize("text, words", [
    (f"{K1}", "line 1: expected `KEY TENANT"),
    ("short acme", "line 1: the key (1st word) must be 16 to 256"),
    (f"\n{K1} acme\n{K2} bad/tenant", "line 3: the tenant (2nd word)"),
    (f"{K1} acme root", "line 1: the 3rd word is not `admin`"),
    (f"{K1} acme max_concurrency=-1", "line 1: max_concurrency must be an integer"),
    (f"{K1} acme\n{K1} other", "line 2: the same key as line 1"),
    (f"{K1} acme max_concurrency=2\n{K2} acme", "line 2: tenant 'acme' has other limits"),
    ("# nothing\n\n", "no keys"),
], ids=["one-word", "short-key", "bad-tenant", "unknown-word", "bad-limit", "duplicate",
        "conflicting-limits", "empty"])
def test_bad_key_file_names_the_line_and_never_echoes_a_key(text: str, words: str) -> None:
    with pytest.raises(KeyFileError) as e:
        parse_keys(text, "keys.txt")
    message = str(e.value)
    assert words in message and message.startswith("keys.txt")
    for secret in (K1, K2, "short", "root", "bad/tenant"):
        assert secret not in message


def test_bearer_header_parsing() -> None:
    assert bearer_key(f"Bearer {K1}") == K1
    assert bearer_key(f"bearer   {K1} ") == K1
    for bad in (None, "", "Bearer", "Bearer ", f"Basic {K1}", K1):
        assert bearer_key(bad) is None


def test_tenant_salt_is_per_tenant_length_prefixed_and_keeps_the_open_salt() -> None:
    a = tenant_salt("acme", None)
    assert a == tenant_salt("acme", "") and a.startswith("tenant-")
    assert a != tenant_salt("acme2", None)
    assert tenant_salt("acme", "x") != a
    # the same concatenation, split differently, must not collide
    assert tenant_salt("ab", "c") != tenant_salt("a", "bc")
    assert len(tenant_salt("t" * 64, "s" * 256)) < 100  # bounded whatever the inputs
    assert tenant_salt("", "client") == "client" and tenant_salt("", None) is None
    assert OPEN.admin and OPEN.tenant == ""


def write(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()  # a distinct mtime even on a coarse clock
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_key_store_reloads_a_changed_file_at_most_once_per_interval(tmp_path: Path) -> None:
    path, clock = tmp_path / "keys", Clock()
    write(path, f"{K1} acme\n")
    path.chmod(0o600)
    store = KeyStore(path, clock=clock)
    assert store.authenticate(K1).tenant == "acme"
    assert store.authenticate(K2) is None and store.authenticate(None) is None
    write(path, f"{K2} ops admin\n")
    clock.now += 0.5
    assert store.authenticate(K1) is not None  # not looked at yet
    clock.now += 0.6
    assert store.authenticate(K1) is None
    assert store.authenticate(K2).admin


def test_malformed_or_missing_reload_keeps_the_keys_and_logs_why(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "keys", Clock()
    write(path, f"{K1} acme\n")
    path.chmod(0o600)
    store = KeyStore(path, clock=clock)
    write(path, f"{K2} acme\n{K3}\n")
    clock.now += 2
    with caplog.at_level(logging.WARNING, logger="router.auth"):
        assert store.authenticate(K1).tenant == "acme"
        assert store.authenticate(K2) is None
    assert "line 2" in caplog.text and "keeping the 1 keys" in caplog.text
    assert K2 not in caplog.text and K3 not in caplog.text
    path.unlink()
    clock.now += 2
    assert store.authenticate(K1).tenant == "acme"
    write(path, f"{K2} ops\n")
    clock.now += 2
    assert store.authenticate(K2).tenant == "ops" and store.authenticate(K1) is None


def test_key_store_refuses_to_start_on_a_bad_file_and_warns_on_open_permissions(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(KeyFileError, match="cannot read"):
        KeyStore(tmp_path / "missing")
    bad = tmp_path / "bad"
    bad.write_text("x y\n")
    with pytest.raises(KeyFileError, match="line 1"):
        KeyStore(bad)
    ok = tmp_path / "ok"
    ok.write_text(f"{K1} acme\n")
    ok.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="router.auth"):
        KeyStore(ok)
    assert "chmod 600" in caplog.text


# -- the tenant limiter ---------------------------------------------------------------------


def test_concurrency_limit_refuses_with_retry_after_until_a_lease_settles() -> None:
    limiter = TenantLimiter(TenantLimits(max_concurrency=2), clock=Clock())
    a, b = limiter.admit("acme", None, 10), limiter.admit("acme", None, 10)
    with pytest.raises(RateLimited) as e:
        limiter.admit("acme", None, 10)
    assert e.value.retry_after_s == 1 and "max_concurrency=2" in e.value.message
    limiter.admit("other", None, 10)  # tenants are apart
    a.settle(5)
    a.settle(5)  # twice is once
    assert limiter.in_flight("acme") == 1
    limiter.admit("acme", None, 10)
    b.settle(0)


def test_token_bucket_reserves_at_admission_refunds_at_settle_and_refills() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(tokens_per_minute=600), clock=clock)  # 10/s
    lease = limiter.admit("acme", None, 500)
    assert limiter.available_tokens("acme") == 100
    with pytest.raises(RateLimited) as e:
        limiter.admit("acme", None, 200)
    assert e.value.retry_after_s == 10  # 100 tokens short at 10 tokens/s
    assert "600 tokens per minute" in e.value.message
    lease.settle(150)  # used 150 of 500: 350 back
    assert limiter.available_tokens("acme") == 450
    limiter.admit("acme", None, 400).settle(400)
    assert limiter.available_tokens("acme") == 50
    clock.now += 30
    assert limiter.available_tokens("acme") == 350
    clock.now += 600
    assert limiter.available_tokens("acme") == 600  # never above a minute's budget


def test_request_larger_than_a_minute_runs_on_a_full_bucket_and_leaves_a_debt() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(tokens_per_minute=60), clock=clock)  # 1/s
    limiter.admit("acme", None, 100).settle(100)
    assert limiter.available_tokens("acme") == -40
    with pytest.raises(RateLimited) as e:
        limiter.admit("acme", None, 10)
    assert e.value.retry_after_s == 50
    clock.now += 50
    limiter.admit("acme", None, 10)


def test_key_line_limits_override_the_defaults_and_zero_is_unlimited() -> None:
    limiter = TenantLimiter(TenantLimits(max_concurrency=1), clock=Clock())
    mine = TenantLimits(max_concurrency=3)
    for _ in range(3):
        limiter.admit("big", mine, 1)
    with pytest.raises(RateLimited):
        limiter.admit("big", mine, 1)
    free = TenantLimiter(TenantLimits(), clock=Clock())
    for _ in range(1000):
        free.admit("t", None, 10**9)
    with pytest.raises(ValueError, match="max_concurrency"):
        TenantLimits(max_concurrency=-1)


# -- the edge's text checks -----------------------------------------------------------------


def test_unencodable_path_names_where_a_lone_surrogate_is() -> None:
    assert unencodable_path({"prompt": "fine", "n": [1, "ok", {"a": "b"}]}) is None
    assert unencodable_path({"prompt": "a\ud800"}) == "prompt"
    body = {"messages": [{"role": "user", "content": "ok"},
                         {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}
    assert unencodable_path(body) == "messages[1].content[0].text"
    assert unencodable_path({"\ud800": 1}) == "<key>"
    deep: list = []
    inner = deep
    for _ in range(5000):  # deeper than Python's recursion limit
        inner.append([])
        inner = inner[0]
    inner.append("\ud800")
    assert unencodable_path(deep).endswith("[0]")


def test_bad_utf8_field_walks_the_wire_format_to_name_the_field() -> None:
    msg = api_pb2.GenerateRequest(request_id="r", messages=api_pb2.ChatMessages(messages=[
        api_pb2.ChatMessage(role="user", content="AAAA"),
        api_pb2.ChatMessage(role="user", content="BBBB")]))
    raw = msg.SerializeToString()
    assert bad_utf8_field(raw, api_pb2.GenerateRequest.DESCRIPTOR) is None
    broken = raw.replace(b"BBBB", b"B\xed\xa0\x80")  # a surrogate, as UTF-8 forbids it
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError, unnamed
        api_pb2.GenerateRequest.FromString(broken)
    assert (bad_utf8_field(broken, api_pb2.GenerateRequest.DESCRIPTOR)
            == "messages.messages[1].content")
    text = api_pb2.GenerateRequest(text="xyz").SerializeToString().replace(b"xyz", b"x\xffz")
    assert bad_utf8_field(text, api_pb2.GenerateRequest.DESCRIPTOR) == "text"
    assert bad_utf8_field(b"\xff\xff\xff", api_pb2.GenerateRequest.DESCRIPTOR) is None


def test_a_lease_admitted_first_and_refused_tokens_later_still_frees_its_place() -> None:
    limiter = TenantLimiter(TenantLimits(max_concurrency=1, tokens_per_minute=60),
                            clock=Clock())
    lease = limiter.admit("acme", None)  # the place, before the prompt is tokenized
    with pytest.raises(RateLimited):
        limiter.admit("acme", None)
    lease.reserve(50)
    with pytest.raises(RateLimited):
        lease.reserve(20)  # 10 left
    assert limiter.available_tokens("acme") == 10  # a refused reservation takes nothing
    lease.settle(0)  # failed before any work: everything back
    assert limiter.in_flight("acme") == 0 and limiter.available_tokens("acme") == 60
