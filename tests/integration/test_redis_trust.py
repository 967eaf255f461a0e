"""Redis as a trust boundary, on real redis-servers: the one ``pdserve up`` starts wants
its password (and never shows it in a command line), ``rediss://`` works with a CA, and
the registry skips entries it cannot trust (logging each once) without losing the good
ones."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis_helpers import redis_server

from cluster.net import free_port
from cluster.redis_server import find_redis_server
from common.redis_url import (
    RedisURL,
    connect,
    password_of,
    redact,
    with_password,
    without_password,
)
from common.registry import WorkerInfo, WorkerRegistry

SECRET = "s3cret-Pa55word_for-tests"


def test_a_url_never_prints_its_password() -> None:
    url = with_password("redis://pdserve@cache.example:6380/2", "p@ss:w/rd")
    assert isinstance(url, RedisURL)
    logged = "%s" % (url,)  # noqa: UP031 - what logging's %s does
    for shown in (str(url), repr(url), f"{url}", logged, f"{url:>60}", repr([url])):
        assert "p@ss" not in shown and "p%40ss" not in shown and "***" in shown
    assert password_of(url) == "p@ss:w/rd"
    assert without_password(url) == "redis://pdserve@cache.example:6380/2"
    assert redact("rediss://:x@h:1/0?ssl_ca_certs=/ca.pem") == "rediss://:***@h:1/0?ssl_ca_certs=/ca.pem"
    assert with_password("redis://h:1/0", None) == "redis://h:1/0"
    assert isinstance(with_password("redis://:inline@h:1/0", None), RedisURL)  # still hidden
    client = connect(url)
    assert client.connection_pool.connection_kwargs["password"] == "p@ss:w/rd"
    assert client.connection_pool.connection_kwargs["username"] == "pdserve"
    client.close()


def test_a_client_without_the_password_is_refused() -> None:
    with redis_server(password=SECRET) as server:
        assert password_of(server.url) == SECRET and SECRET not in str(server.url)
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert SECRET.encode() not in cmdline  # the settings came on stdin
        bare = connect(without_password(server.url))
        with pytest.raises(redis.AuthenticationError):  # NOAUTH
            bare.ping()
        wrong = connect(with_password(server.url, "guess"))
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        good = connect(server.url)
        assert good.ping()
        with pytest.raises(redis.ResponseError, match="no permissions"):
            good.config_get("dir")  # @admin: no CONFIG SET dir/dbfilename to a shell
        registry = WorkerRegistry(good, "m")
        info = registry.register(WorkerInfo("w1", "decode", "127.0.0.1:1", 8, 16), {}, 5.0)
        assert [w.info for w in registry.live()] == [info]
        for c in (bare, wrong, good):
            c.close()


def _tls_material(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, signer, ca: bool, san: bool):  # noqa: ANN001, ANN202
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("pdserve test CA", ca_key, "pdserve test CA", ca_key, True, False)
    server = cert("127.0.0.1", key, "pdserve test CA", ca_key, False, True)
    paths = tmp / "ca.pem", tmp / "server.pem", tmp / "server-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_rediss_with_a_ca_and_a_password(tmp_path: Path) -> None:
    binary = shutil.which("redis-server") or find_redis_server()
    if binary is None or b"tls-port" not in Path(binary).read_bytes():
        pytest.skip("no redis-server built with TLS (Debian's is)")
    ca, cert, key = _tls_material(tmp_path)
    port = free_port()
    settings = (f"port 0\ntls-port {port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\n"
                f"tls-cert-file {cert}\ntls-key-file {key}\ntls-auth-clients no\n"
                f"user default reset on >{SECRET} ~* &* +@all -@admin\n")
    proc = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None
    proc.stdin.write(settings.encode())
    proc.stdin.close()
    url = with_password(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", SECRET)
    try:
        client = connect(url, socket_timeout=2, socket_connect_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "no TLS Redis"
                time.sleep(0.1)
        registry = WorkerRegistry(client, "m")
        registry.register(WorkerInfo("w1", "prefill", "127.0.0.1:1", 8, 16), {}, 5.0)
        assert len(registry.live()) == 1
        client.close()
        untrusted = connect(with_password(f"rediss://127.0.0.1:{port}/0", SECRET),
                            socket_timeout=2, socket_connect_timeout=2)
        with pytest.raises(redis.ConnectionError):  # the system CAs never signed it
            untrusted.ping()
        untrusted.close()
    finally:
        proc.terminate()
        proc.wait(10)


GOOD = {"worker_id": "10.0.0.1:50061", "role": "decode", "address": "10.0.0.1:50061",
        "total_blocks": 100, "block_size": 16, "epoch": 3, "model": "m"}
BAD_ENTRIES: dict[str, tuple[object, str]] = {
    "not-json": ("{nope", "not JSON"),
    "a-list": ([1, 2], "not an object"),
    "no-address": ({k: v for k, v in GOOD.items() if k != "address"}, "missing address"),
    "no-model": ({k: v for k, v in GOOD.items() if k != "model"}, "missing model"),
    "other-model": ({**GOOD, "model": "evil"}, "serves model 'evil'"),
    "role-int": ({**GOOD, "role": 7}, "role is a int"),
    "role-unknown": ({**GOOD, "role": "admin"}, "role 'admin'"),
    "blocks-negative": ({**GOOD, "total_blocks": -1}, "total_blocks=-1"),
    "blocks-huge": ({**GOOD, "total_blocks": 10**30}, "total_blocks="),
    "blocks-bool": ({**GOOD, "total_blocks": True}, "total_blocks=True"),
    "blocks-str": ({**GOOD, "block_size": "16"}, "block_size='16'"),
    "address-url": ({**GOOD, "address": "http://evil/x:80"}, "want HOST:PORT"),
    "address-port": ({**GOOD, "address": "10.0.0.9:99999"}, "want HOST:PORT"),
    "address-space": ({**GOOD, "address": "a b:1"}, "want HOST:PORT"),
    "deep": ("[" * 100_000, "not JSON"),
}


def _plant(client: redis.Redis, key: str | bytes, entry: object, load: object,
           prefix: str = "pdserve:m:") -> None:
    raw = entry if isinstance(entry, str) else json.dumps(entry)
    client.hset(f"{prefix}workers", key, raw)
    name = key.decode(errors="replace") if isinstance(key, bytes) else key
    client.set(f"{prefix}alive:{name}", load if isinstance(load, str) else json.dumps(load),
               px=60_000)


def test_malformed_entries_are_skipped_and_logged_once(caplog) -> None:
    with redis_server() as server:  # a user's own password-less Redis still works
        client = connect(server.url)
        registry = WorkerRegistry(client, "m")
        good = registry.register(WorkerInfo("10.0.0.2:50061", "prefill", "10.0.0.2:50061",
                                            64, 16), {"running": 1, "free_blocks": 60}, 60.0)
        for name, (entry, _) in BAD_ENTRIES.items():
            worker = f"10.9.9.9:{name}"
            if isinstance(entry, dict) and "worker_id" in entry:
                entry = {**entry, "worker_id": worker}
            _plant(client, worker, entry, {"running": 0})
        _plant(client, "10.0.0.3:50061", {**GOOD, "worker_id": "someone-else"}, {})
        _plant(client, "10.0.0.4:50061", {**GOOD, "worker_id": "10.0.0.4:50061",
                                          "address": "10.0.0.4:50061"}, {"running": -1})
        _plant(client, "10.0.0.5:50061", {**GOOD, "worker_id": "10.0.0.5:50061",
                                          "address": "10.0.0.5:50061"}, "NaN")
        _plant(client, b"\xff\xfe", GOOD, {})
        newer = {**GOOD, "worker_id": "10.0.0.6:50061", "address": "[fd00::6]:50061",
                 "gpu": "H200"}  # a field from a newer worker: ignored, not fatal
        _plant(client, "10.0.0.6:50061", newer, {"running": 0.0})

        with caplog.at_level(logging.WARNING, logger="common.registry"):
            live = registry.live()
            assert sorted(w.info.worker_id for w in live) == ["10.0.0.2:50061",
                                                              "10.0.0.6:50061"]
            assert live[0].info == good and live[0].load == {"running": 1, "free_blocks": 60}
            first = [r.getMessage() for r in caplog.records]
            for name, (_, why) in BAD_ENTRIES.items():
                assert any(f"10.9.9.9:{name}" in m and why in m for m in first), (name, first)
            assert any("names 'someone-else'" in m for m in first)
            assert sum("10.0.0.4" in m and "load" in m for m in first) == 1
            assert any("10.0.0.5" in m and "load" in m for m in first)
            assert len(first) == len(BAD_ENTRIES) + 4
            caplog.clear()
            for _ in range(3):  # heartbeats rewrite loads; nothing new to say
                client.set("pdserve:m:alive:10.0.0.4:50061", json.dumps({"running": -2}))
                assert len(registry.live()) == 2
            assert caplog.records == []
        client.close()


def test_an_expired_junk_entry_is_removed(caplog) -> None:
    with redis_server() as server:
        client = connect(server.url)
        registry = WorkerRegistry(client, "m")
        client.hset("pdserve:m:workers", b"\xff", b"junk")  # no alive key: expired
        client.hset("pdserve:m:workers", "w9", "{nope")
        assert registry.live() == []
        assert client.hlen("pdserve:m:workers") == 0
        client.close()
