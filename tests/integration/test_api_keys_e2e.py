"""API keys and tenants on a real cluster (router + 1 prefill + 1 decode worker, real
gRPC, real gloo transfer, the tiny llama): no key, no service; a key serves as before;
tenants never see each other's prefix cache; only admins see the cluster; no leak."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from cluster_helpers import assert_cluster_idle, start

from router.client import Client

ALICE = "sk-alice-" + "a" * 24
BOB = "sk-bob-" + "b" * 24
OPS = "sk-ops-" + "c" * 24
PROMPT = [(7 * i) % 200 + 3 for i in range(300)]  # remote (past the local-prefill threshold),
# and whole blocks of the default 64 tokens to cache
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def keyed(tiny_checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    keys = tmp / "keys"
    keys.write_text(f"# KEY TENANT [admin]\n{ALICE} alice\n{BOB} bob\n{OPS} ops admin\n")
    keys.chmod(0o600)
    c = start(tiny_checkpoints["llama"], tmp / "logs", prefill=1, decode=1,
              api_keys=str(keys))
    yield c
    c.stop()


def _http(cluster, path: str, key: str | None, body: dict | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(cluster.http_url + path, headers=headers,
                                 data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_no_key_or_a_wrong_key_is_refused_on_both_fronts(keyed) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    assert _http(keyed, "/v1/completions", None, body) == 401
    assert _http(keyed, "/v1/completions", "sk-wrong-" + "x" * 24, body) == 401
    assert _http(keyed, "/v1/models", None) == 401
    assert _http(keyed, "/health", None) == 200
    with Client(keyed.target) as anonymous:
        with pytest.raises(grpc.RpcError) as e:
            anonymous.generate(PROMPT, **GREEDY)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.serving()  # health stays open for probes
    assert _http(keyed, "/v1/completions", ALICE, body) == 200
    assert_cluster_idle(keyed, api_key=OPS)


def test_tenants_share_their_own_cache_and_never_another_tenants(keyed) -> None:
    with Client(keyed.target, api_key=ALICE) as alice, \
            Client(keyed.target, api_key=BOB) as bob:
        first = alice.generate(PROMPT, **GREEDY)
        again = alice.generate(PROMPT, **GREEDY)
        probe = bob.generate(PROMPT, **GREEDY)
    assert again.usage["cached_tokens"] >= 256  # alice's own blocks, reused
    assert probe.usage["cached_tokens"] == 0  # alice's blocks are not bob's
    # The same greedy tokens whichever tenant and whether cached or not: works as before.
    assert first.token_ids == again.token_ids == probe.token_ids
    assert len(first.token_ids) == GREEDY["max_tokens"]
    assert_cluster_idle(keyed, api_key=OPS)


def test_only_admins_see_the_cluster_and_where_requests_ran(keyed) -> None:
    with Client(keyed.target, api_key=ALICE) as alice, \
            Client(keyed.target, api_key=OPS) as ops:
        with pytest.raises(grpc.RpcError) as e:
            alice.status()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        mine = alice.generate(PROMPT[:40], **GREEDY)
        theirs = ops.generate(PROMPT[:40], **GREEDY)
        assert {w.role for w in ops.status().workers} == {"prefill", "decode"}
    assert not mine.routing.get("worker") and not mine.routing.get("decode_worker")
    assert theirs.routing.get("decode_worker")
    assert _http(keyed, "/metrics", ALICE) == 403 and _http(keyed, "/metrics", OPS) == 200
    assert_cluster_idle(keyed, api_key=OPS)
