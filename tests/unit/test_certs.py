"""``pdserve certs``: the development chain verifies, names what it must, and is written
safely (keys 0600, no silent overwrite)."""

from __future__ import annotations

import datetime
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from cluster.certs import FILES, CertsError, make_dev_pki
from common.tls import CLUSTER_SERVER_NAME, ClusterTLS, ServerTLS, TLSError, load_cluster_secret


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_dev_chain_verifies_and_names_the_cluster_and_router_hosts(tmp_path: Path) -> None:
    now = datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)
    pki = make_dev_pki(tmp_path / "pki", ["router.example", "10.0.0.7"], days=30, now=now)
    ca, cluster, router = _cert(pki.ca), _cert(pki.cluster_cert), _cert(pki.router_cert)
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert ca.public_key().curve.name == "secp256r1"
    ca.verify_directly_issued_by(ca)  # self-signed
    cluster.verify_directly_issued_by(ca)
    router.verify_directly_issued_by(ca)
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    for leaf in (cluster, router):
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        ku = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
        assert ku.digital_signature and not ku.key_cert_sign
        assert leaf.not_valid_before_utc <= now < leaf.not_valid_after_utc
        assert leaf.not_valid_after_utc - leaf.not_valid_before_utc == datetime.timedelta(days=30)
        assert leaf.not_valid_after_utc <= ca.not_valid_after_utc
    san = cluster.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [CLUSTER_SERVER_NAME]
    eku = cluster.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    san = router.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "router.example"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"),
        ipaddress.ip_address("10.0.0.7")]
    assert list(router.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    # each key belongs to its certificate
    tls = ClusterTLS.from_dir(pki.directory)
    from cryptography.hazmat.primitives.serialization import load_pem_private_key
    key = load_pem_private_key(tls.key, None)
    assert key.public_key().public_numbers() == cluster.public_key().public_numbers()


def test_keys_are_private_and_an_existing_set_is_not_overwritten(tmp_path: Path) -> None:
    pki = make_dev_pki(tmp_path / "pki")
    assert stat.S_IMODE(pki.directory.stat().st_mode) == 0o700
    for path in (pki.ca_key, pki.cluster_key, pki.router_key, pki.secret):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(pki.ca.stat().st_mode) == 0o644
    before = {f: (pki.directory / f).read_bytes() for f in FILES}
    with pytest.raises(CertsError, match="--force"):
        make_dev_pki(pki.directory)
    assert {f: (pki.directory / f).read_bytes() for f in FILES} == before
    again = make_dev_pki(pki.directory, force=True)
    assert again.ca.read_bytes() != before["ca.pem"]
    assert stat.S_IMODE(again.cluster_key.stat().st_mode) == 0o600


def test_tls_material_loads_once_and_bad_files_are_named(tmp_path: Path) -> None:
    pki = make_dev_pki(tmp_path / "pki")
    tls = ClusterTLS.from_dir(pki.directory)
    assert "BEGIN" not in repr(tls)  # keys never end up in logs
    tls.server_credentials(), tls.channel_credentials()  # noqa: B018 - grpc accepts them
    ServerTLS.from_files(pki.router_cert, pki.router_key).ssl_context()
    secret = load_cluster_secret(pki.secret)
    assert len(secret) == 32 and secret != tls.kv_secret()
    assert ClusterTLS.from_dir(pki.directory).kv_secret() == tls.kv_secret()
    with pytest.raises(TLSError, match="does not exist"):
        ClusterTLS.from_dir(tmp_path / "nope")
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(TLSError, match="at least 16"):
        load_cluster_secret(short)
    (pki.directory / "cluster-key.pem").unlink()
    with pytest.raises(TLSError, match="cluster-key.pem"):
        ClusterTLS.from_dir(pki.directory)


def test_certs_command_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture
                                            ) -> None:
    from cluster.cli import main

    out = tmp_path / "d"
    assert main(["certs", "--out", str(out), "--hosts", "a.example,10.1.2.3"]) == 0
    assert "--cluster-tls-dir" in capsys.readouterr().out
    assert main(["certs", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


def test_up_checks_the_trust_files_and_hands_components_absolute_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from cluster.cli import build_parser
    from cluster.cli.serve import trust_checked
    from cluster.deployment import DeploymentConfig

    pki = make_dev_pki(tmp_path / "pki")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET_FILE", "pki/cluster-secret")
    config = DeploymentConfig(cluster_tls_dir="pki", tls_cert="pki/router.pem",
                              tls_key="pki/router-key.pem")
    checked = trust_checked(config)
    assert checked.cluster_tls_dir == str(pki.directory)
    assert checked.cluster_secret_file == str(pki.secret)  # from the environment, once
    assert checked.client_tls_ca == str(pki.ca)
    worker = checked.worker_args("decode", "127.0.0.1", 0, None, 1)
    args = build_parser().parse_args(worker)
    assert (args.cluster_tls_dir, args.cluster_secret_file) == (str(pki.directory),
                                                                str(pki.secret))
    router = build_parser().parse_args(checked.router_args([], None))
    assert (router.cluster_tls_dir, router.tls_cert, router.tls_key) == (
        str(pki.directory), str(pki.router_cert), str(pki.router_key))
    assert "--cluster-secret-file" not in checked.router_args([], None)  # workers only
    with pytest.raises(ValueError, match="together"):
        trust_checked(dataclasses.replace(config, tls_key=None))
    (pki.directory / "cluster-key.pem").unlink()
    with pytest.raises(ValueError, match="cluster-key.pem"):
        trust_checked(config)
    plain = DeploymentConfig()
    assert plain.client_tls_ca is None and "--cluster-tls-dir" not in plain.worker_args(
        "mixed", "127.0.0.1", 0, None, 1)
