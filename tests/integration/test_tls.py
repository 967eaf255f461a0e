"""The trust boundary inside the cluster, for real.

- **KV channel** (a keyed decode receiver in this process, prefill senders in threads;
  real TCPStore, real gloo): a join with a wrong or no secret is refused and opens no
  pair; a replayed or stale join is refused; an offer without a valid MAC is dropped and
  the reservation still takes the real one; a peer that cannot sign its accept gets no
  KV. Every test ends with the receiver idle and closed.
- **A cluster with TLS everywhere** (``pdserve certs`` material; router with public TLS
  on gRPC and HTTP, 1 prefill + 1 decode worker with mTLS, Redis, the KV key derived
  from the cluster key): greedy output equals the offline engine's; a worker refuses a
  client without the cluster's certificate (``SetRole`` too); a ``Prefill`` naming an
  unregistered target computes and sends nothing; it ends with the leak check.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist

from cluster.certs import DevPKI, make_dev_pki
from common.request import Request
from common.sampling import SamplingParams
from common.tls import CLUSTER_SERVER_NAME, ClusterTLS, client_ssl_context
from common.wire import request_to_proto
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.client import Client
from workers.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    PagedCacheDestination,
    TransferConfig,
    TransferHeader,
    TransferState,
    request_id64,
)
from workers.transfer import sender as sender_module
from workers.transfer.auth import ChannelAuth
from workers.transfer.header import encode_offer
from workers.transfer.rendezvous import JOIN_PREFIX, ROOT, STOP, connect_store, listen_store

KEY, OTHER = b"k" * 32, b"x" * 32
CFG = dict(connect_timeout_s=10.0, offer_timeout_s=2.0, data_timeout_s=5.0,
           expect_timeout_s=20.0)
LAYOUT = KVLayout(2, 16, 2, 32, torch.float32)
SENTINEL = -7.0


def _cache() -> torch.Tensor:
    return torch.full((2, 2, 16 * 16, 2, 32), SENTINEL)


def _kv(seed: int, n: int) -> torch.Tensor:
    return torch.randn(LAYOUT.payload_shape(n), generator=torch.Generator().manual_seed(seed))


def _blocks(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    view = cache.view(2, 2, -1, 16, 2, 32)
    return torch.stack([view[:, :, b] for b in ids], dim=2)


def _until(cond, what: str, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _raw_inbox(address: str) -> dist.PrefixStore:
    """What any process that reaches the store's port can do: a plain client."""
    host, port = address.rsplit(":", 1)
    return dist.PrefixStore(ROOT, connect_store(host, int(port), 10.0))


@pytest.fixture
def decode() -> Iterator[KVReceiver]:
    rx = KVReceiver("decode-keyed", TransferConfig(**CFG, auth_key=KEY))
    yield rx
    _until(lambda: not (rx.live_transfers() or rx.parked_offers() or rx.stats().in_flight),
           "the receiver to go idle")
    rx.close()


def test_a_join_without_the_secret_is_refused_and_opens_no_pair(decode: KVReceiver) -> None:
    ids = [3, 5, 6]
    cache = _cache()
    h = decode.expect("req-wrong", LAYOUT, ids, PagedCacheDestination(cache, ids, 16))
    kv = _kv(1, len(ids))
    for name, key, refused in (("prefill-wrong", OTHER, "bad_mac"),
                               ("prefill-plain", None, "unauthenticated")):
        sender = KVSender(name, TransferConfig(**CFG, auth_key=key))
        try:
            r = sender.send(decode.address, "req-wrong", ids, kv).wait(30)
        finally:
            sender.close()
        assert r.state is TransferState.FAILED and "join refused" in (r.reason or ""), r
        assert decode.stats().refused.get(refused) == 1, decode.stats()
        assert decode.stats().pairs_open == 0
    assert h.state is TransferState.PENDING  # nothing matched the reservation
    assert bool((cache == SENTINEL).all())  # and nothing was written
    right = KVSender("prefill-right", TransferConfig(**CFG, auth_key=KEY))
    try:
        assert right.send(decode.address, "req-wrong", ids, kv).wait(30).ok
    finally:
        right.close()
    assert h.wait(10).ok and torch.equal(_blocks(cache, ids), kv)


def test_replayed_and_stale_joins_and_forged_offers_are_refused(decode: KVReceiver) -> None:
    sender = KVSender("prefill-a", TransferConfig(**CFG, auth_key=KEY))
    joins: list[bytes] = []
    real_join = sender.join_message

    def recording(address: str, pair_id: int) -> tuple[bytes, bytes]:
        session, msg = real_join(address, pair_id)
        joins.append(msg)  # as an eavesdropper on the store's port would see it
        return session, msg

    sender.join_message = recording  # type: ignore[method-assign]
    raw = _raw_inbox(decode.address)
    try:
        ids = [1, 2]
        cache = _cache()
        first = decode.expect("req-1", LAYOUT, ids, PagedCacheDestination(cache, ids, 16))
        assert sender.send(decode.address, "req-1", ids, _kv(2, 2)).wait(30).ok
        assert first.wait(10).ok and len(joins) == 1 and decode.stats().pairs_open == 1
        (pair_id,) = decode._pairs  # the one pair the real join opened

        raw.queue_push("inbox", joins[0])  # replayed verbatim, within the window
        _until(lambda: decode.stats().refused.get("replay") == 1, "the replay to be refused")
        old = ChannelAuth(KEY, clock=lambda: time.time() - 60)  # right key, a minute ago
        stamp = old.stamp("join", decode.address, b"", f"{pair_id + 7} gloo mallory".encode())
        raw.queue_push("inbox", JOIN_PREFIX + f"v2 {pair_id + 7} gloo {stamp.to_text()} "
                                              "mallory".encode())
        _until(lambda: decode.stats().refused.get("stale") == 1, "the stale join refused")
        assert decode.stats().pairs_open == 1  # the real pair, and nothing else

        ids2 = [8, 9, 10]
        cache2 = _cache()
        h = decode.expect("req-2", LAYOUT, ids2, PagedCacheDestination(cache2, ids2, 16))
        forged = encode_offer(TransferHeader(request_id64("req-2"), 900, pair_id, 3, LAYOUT,
                                             LAYOUT.payload_bytes(3), 1, 0), ids2)
        raw.queue_push("inbox", forged)  # unsigned, on the real pair
        bad = ChannelAuth(OTHER).stamp("offer", decode.address, b"guess", forged)
        raw.queue_push("inbox", b"S" + bad.to_bytes() + forged)  # signed with another key
        raw.queue_push("inbox", STOP)  # any client can push one; the inbox must go on
        _until(lambda: decode.stats().refused.get("stop") == 1, "the forged messages")
        refused = decode.stats().refused
        assert refused.get("unauthenticated") == 1 and refused.get("bad_mac") == 1, refused
        assert h.state is TransferState.PENDING and bool((cache2 == SENTINEL).all())
        kv = _kv(3, 3)  # the real offer still lands
        assert sender.send(decode.address, "req-2", ids2, kv).wait(30).ok
        assert h.wait(10).ok and torch.equal(_blocks(cache2, ids2), kv)
    finally:
        sender.close()


def test_a_peer_that_cannot_sign_its_accept_gets_no_kv() -> None:
    """A store at a caller-chosen address that accepts every join (it has no key): the
    keyed prefill sends nothing there, not even a process-group rendezvous."""
    store = listen_store("127.0.0.1", 0, 10.0)
    fake = dist.PrefixStore(ROOT, store.clone())
    seen: list[bytes] = []

    def accept_everything() -> None:
        msg = fake.queue_pop("inbox", True)
        seen.append(msg)
        pair_id = msg.decode().split(" ")[1]
        fake.set(f"join/{pair_id}", b"A")

    t = threading.Thread(target=accept_everything, daemon=True)
    t.start()
    sender = KVSender("prefill-b", TransferConfig(**CFG, auth_key=KEY))
    try:
        r = sender.send(f"127.0.0.1:{store.port}", "req-x", [0], _kv(4, 1)).wait(30)
    finally:
        sender.close()
    t.join(5)
    assert r.state is TransferState.FAILED and "signed" in (r.reason or ""), r
    assert seen and seen[0].startswith(b"Jv2 ")
    assert not fake.check(["pair/1/pg/0"]) and not fake.check(["pair/1/pg/1"])


def test_an_early_offer_lands_keyed_and_a_trailer_that_does_not_verify_fails_it(
        decode: KVReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """An early offer's trailer (its checksum) carries a MAC under the cluster key: with
    it the KV lands; a trailer altered on the way (one MAC byte flipped, as an on-path
    attacker would) is refused, counted, and the transfer fails on a closed pair."""
    real = sender_module._SendPair.trailer

    def forged(self, seq: int, checksum: int, status: int) -> torch.Tensor:  # noqa: ANN001
        t = real(self, seq, checksum, status).clone()
        t[-1] ^= 0xFF
        return t

    sender = KVSender("prefill-early", TransferConfig(**CFG, auth_key=KEY))
    src_cache = torch.zeros(2, 2, 4 * 16, 2, 32)
    try:
        for rid, ids, tamper in (("early-ok", [2, 4], False), ("early-forged", [6, 7], True)):
            if tamper:
                monkeypatch.setattr(sender_module._SendPair, "trailer", forged)
            cache = _cache()
            h = decode.expect(rid, LAYOUT, ids, PagedCacheDestination(cache, ids, 16))
            offer = sender.offer_paged(decode.address, rid, src_cache, [0, 1], ids, 16)
            _until(lambda h=h: h.state is TransferState.RECEIVING, "the early accept")
            kv = _kv(7, 2)
            src_cache.view(2, 2, -1, 16, 2, 32)[:, :, 0:2] = kv
            assert offer.go()
            assert offer.handle.wait(30).ok  # the sender cannot tell
            result = h.wait(30)
            if not tamper:
                assert result.ok and torch.equal(_blocks(cache, ids), kv), result
            else:
                assert result.state is TransferState.FAILED, result
                assert "does not verify" in (result.reason or ""), result
                assert decode.stats().refused.get("bad_mac") == 1, decode.stats()
                assert decode.stats().pairs_open == 0
    finally:
        sender.close()


def test_pairs_parked_offers_and_reservations_are_bounded() -> None:
    rx = KVReceiver("decode-small", TransferConfig(**CFG, auth_key=KEY, max_pairs=1,
                                                   max_parked_offers=1, max_reservations=1))
    a = KVSender("prefill-a", TransferConfig(**CFG, auth_key=KEY))
    b = KVSender("prefill-b", TransferConfig(**CFG, auth_key=KEY))
    try:
        cache = _cache()
        h = rx.expect("req-a", LAYOUT, [0], PagedCacheDestination(cache, [0], 16))
        with pytest.raises(RuntimeError, match="max_reservations"):
            rx.expect("req-b", LAYOUT, [1], PagedCacheDestination(cache, [1], 16))
        assert a.send(rx.address, "req-a", [0], _kv(5, 1)).wait(30).ok and h.wait(10).ok
        assert rx.stats().pairs_open == 1
        # b's join at the bound replaces a's idle pair; an offer nobody reserved for waits
        # (parked), and a second one is refused at once
        parked = b.send(rx.address, "nobody-1", [2], _kv(6, 1), timeout_s=3.0)
        _until(lambda: rx.parked_offers() == 1, "the first offer to be parked")
        assert rx.stats().pairs_open == 1
        r = b.send(rx.address, "nobody-2", [3], _kv(7, 1)).wait(30)
        assert r.state is TransferState.FAILED and "max_parked_offers" in (r.reason or "")
        assert rx.stats().refused.get("parked_full") == 1
        assert not parked.wait(30).ok  # the decode side dropped it after offer_timeout_s
        _until(lambda: rx.parked_offers() == 0, "the parked offer to expire")
        h2 = rx.expect("req-a2", LAYOUT, [4], PagedCacheDestination(cache, [4], 16))
        assert a.send(rx.address, "req-a2", [4], _kv(8, 1)).wait(30).ok  # a rejoins
        assert h2.wait(10).ok and rx.stats().pairs_open == 1
    finally:
        a.close()
        b.close()
        rx.close()


# --- a whole cluster with TLS ---------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPKI:
    return make_dev_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_cluster(tiny_checkpoints, pki: DevPKI, tmp_path_factory):  # noqa: ANN001, ANN201
    from cluster_helpers import start

    c = start(tiny_checkpoints["llama"], tmp_path_factory.mktemp("tls-logs"), prefill=1,
              decode=1, block_size=4, local_prefill_threshold=0,
              cluster_tls_dir=str(pki.directory), tls_cert=str(pki.router_cert),
              tls_key=str(pki.router_key))
    yield c
    c.stop()


def _worker(cluster, role: str) -> str:  # noqa: ANN001
    return next(a for (_, r), a in zip(cluster.workers, cluster.worker_addresses, strict=True)
                if r == role)


def _get_load(address: str, creds: grpc.ChannelCredentials | None,
              name: str | None = CLUSTER_SERVER_NAME) -> worker_pb2.WorkerLoad:
    options = [("grpc.ssl_target_name_override", name)] if creds and name else []
    channel = (grpc.secure_channel(address, creds, options) if creds
               else grpc.insecure_channel(address))
    with channel:
        return worker_pb2_grpc.WorkerStub(channel).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=5)


def test_cluster_serves_over_tls_and_workers_refuse_strangers(tls_cluster, pki: DevPKI,
                                                              tiny_checkpoints,
                                                              tmp_path: Path) -> None:
    from workers.engine.llm import LLM
    from workers.engine.params import SamplingParams as EngineParams

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46]]
    with Client(tls_cluster.target, str(pki.ca)) as client:
        served = [client.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True)
                  for p in prompts]
        status = client.status()
    offline = LLM(tiny_checkpoints["llama"], dtype="float32", block_size=4,
                  num_threads=1).generate(
        prompts, EngineParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [s.token_ids for s in served] == [o.token_ids for o in offline]
    decode_status = next(w for w in status.workers if w.role == "decode")
    assert decode_status.transfers.entered["done"] >= 2  # the KV moved, under the key

    with pytest.raises(grpc.RpcError) as e:  # the public port speaks TLS only
        with Client(tls_cluster.target) as plain:
            plain.status(timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    https = f"https://127.0.0.1:{tls_cluster.config.http_port}/v1/models"
    with urllib.request.urlopen(https, context=client_ssl_context(pki.ca), timeout=10) as r:
        assert json.load(r)["data"][0]["id"]
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        urllib.request.urlopen(https, timeout=10)  # no CA: the certificate is not trusted

    worker = _worker(tls_cluster, "decode")
    tls = ClusterTLS.from_dir(pki.directory)
    assert _get_load(worker, tls.channel_credentials()).role == "decode"
    stranger = make_dev_pki(tmp_path / "stranger")  # a certificate from another CA
    for creds in (None,  # plaintext
                  grpc.ssl_channel_credentials(root_certificates=tls.ca),  # no client cert
                  grpc.ssl_channel_credentials(
                      root_certificates=tls.ca, private_key=stranger.cluster_key.read_bytes(),
                      certificate_chain=stranger.cluster_cert.read_bytes())):
        with pytest.raises(grpc.RpcError) as e:
            _get_load(worker, creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, creds


def test_prefill_to_an_unregistered_target_sends_nothing(tls_cluster, pki: DevPKI) -> None:
    """Even a receiver holding the cluster's key gets nothing while the registry does
    not list it: the prefill worker refuses before computing."""
    tls = ClusterTLS.from_dir(pki.directory)
    rogue = KVReceiver("rogue", TransferConfig(**CFG, auth_key=tls.kv_secret()))
    try:
        prefill = _worker(tls_cluster, "prefill")
        req = Request("probe-unregistered", tuple(range(5, 25)),
                      SamplingParams(max_tokens=2, temperature=0.0))
        msg = worker_pb2.PrefillRequest(
            request=request_to_proto(req),
            target=worker_pb2.KVTarget(address=rogue.address, block_ids=[0, 1, 2, 3, 4]))
        options = [("grpc.ssl_target_name_override", CLUSTER_SERVER_NAME)]
        with grpc.secure_channel(prefill, tls.channel_credentials(), options) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Prefill(msg, timeout=20)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
            assert "registry" in (e.value.details() or "")
            load = stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert load.free_blocks == load.total_blocks and load.running_requests == 0
        time.sleep(0.5)  # anything on its way would have arrived by now
        stats = rogue.stats()
        assert stats.pairs_open == 0 and not stats.refused and not any(stats.entered.values())
    finally:
        rogue.close()
    with Client(tls_cluster.target, str(pki.ca)) as client:  # registered targets still work
        out = client.generate(list(range(60, 75)), max_tokens=3, temperature=0.0)
        assert len(out.token_ids) == 3
        _until(lambda: _idle(client.status()), "every block free and nothing in flight", 15)


def _idle(status) -> bool:  # noqa: ANN001 - api_pb2.GetStatusResponse
    return status.requests_in_flight == 0 and all(
        w.serving and not (w.running_requests or w.waiting_requests or w.reserved_requests
                           or w.transfers.in_flight) and w.free_blocks == w.total_blocks
        for w in status.workers)


def test_set_role_is_behind_the_same_mutual_tls(tls_cluster) -> None:  # noqa: ANN001
    """``SetRole`` (workers/roles.py) rides the workers' mTLS listener like every other
    worker call: the launcher, holding the cluster certificate, gets an answer (its role
    already: nothing to drain); a client without one never reaches the method."""
    answer = tls_cluster.set_role("decode-0", "decode", "test: over mTLS")
    assert (answer.role, answer.previous_role, answer.drained_s) == ("decode", "decode", 0.0)
    with grpc.insecure_channel(_worker(tls_cluster, "decode")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerStub(ch).SetRole(worker_pb2.SetRoleRequest(role="prefill"),
                                                   timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _get_load(_worker(tls_cluster, "decode"),
                     ClusterTLS.from_dir(tls_cluster.config.cluster_tls_dir)
                     .channel_credentials()).role == "decode"
