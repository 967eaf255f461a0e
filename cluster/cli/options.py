"""What the command groups share: the environment (read here, once), the engine flags
of ``pdserve worker`` and ``pdserve generate``, and flags built from
:class:`~cluster.deployment.DeploymentConfig`'s fields, so a setting's default and help
are written once, next to the field (``pdserve up`` has one flag per field; ``worker``,
``router`` and ``generate`` take the settings they share with it)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path

from cluster.deployment import DeploymentConfig, flag_of
from common.redis_url import PASSWORD_ENV
from router.policies import POLICIES
from workers.engine.params import DTYPE_CHOICES, KV_CACHE_DTYPES, QUANTIZATION_CHOICES

EXIT_INVALID = 2

CHOICES: dict[str, tuple[str, ...]] = {"dtype": DTYPE_CHOICES,
                                        "kv_cache_dtype": KV_CACHE_DTYPES,
                                        "quantization": QUANTIZATION_CHOICES,
                                        "policy": tuple(sorted(POLICIES))}
"""Choices of settings whose valid values live with the component that checks them (the
engine, the router), not in the deployment file's module."""

_FIELDS = {f.name: f for f in dataclasses.fields(DeploymentConfig)}
_HINTS = typing.get_type_hints(DeploymentConfig)
_FIELD_DEFAULT = object()


def add_redis_password_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-password-file", default=None, metavar="FILE",
                   help="file holding the Redis password (default: $PDSERVE_REDIS_PASSWORD; "
                        "a password inside --redis-url shows in the process list)")


def redis_password(args: argparse.Namespace, given: str | None = None) -> str | None:
    """The Redis password: ``given`` (a launcher handed it over), else the file of
    ``--redis-password-file``, else ``$PDSERVE_REDIS_PASSWORD``; None: none. Raises
    ValueError naming the file when it cannot be read."""
    if given:
        return given
    path = getattr(args, "redis_password_file", None)
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as e:
            raise ValueError(f"--redis-password-file {path}: cannot read it ({e.strerror})") \
                from None
    return os.environ.get(PASSWORD_ENV) or None


SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"


def secret_file(given: str | None) -> str | None:
    """``--cluster-secret-file``, else ``$PDSERVE_CLUSTER_SECRET_FILE``; None: none."""
    return given or os.environ.get(SECRET_FILE_ENV) or None


def cluster_tls(args: argparse.Namespace):  # noqa: ANN201 - common.tls.ClusterTLS | None
    """``--cluster-tls-dir``'s material, read once here; None: plaintext. Raises
    TLSError (a ValueError) naming the file."""
    from common.tls import ClusterTLS

    return ClusterTLS.from_dir(args.cluster_tls_dir) if args.cluster_tls_dir else None


def kv_channel_key(args: argparse.Namespace, tls) -> bytes | None:  # noqa: ANN001
    """The KV channel's key: from the secret file (flag or environment), else derived
    from the cluster TLS key, else None (unauthenticated; the receiver says so)."""
    from common.tls import load_cluster_secret

    path = secret_file(args.cluster_secret_file)
    if path:
        return load_cluster_secret(path)
    return tls.kv_secret() if tls is not None else None


def cache_dir(args: argparse.Namespace) -> Path | None:
    """``--cache-dir``, else ``$PDSERVE_CACHE_DIR``; None: the model store's default."""
    value = args.cache_dir or os.environ.get("PDSERVE_CACHE_DIR")
    return Path(value) if value else None


def _scalar(hint: object) -> type:
    """``int | None`` -> ``int``: what a flag's value converts to."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (kind,) = [h for h in typing.get_args(hint) if h is not type(None)]
        return kind
    return hint  # type: ignore[return-value]


def add_setting(p: argparse.ArgumentParser, name: str,
                default: object = _FIELD_DEFAULT) -> None:
    """Add the flag of DeploymentConfig field ``name`` to ``p``: the field's flag, type,
    choices and help, the help ending with the field's default. The flag's own default is
    the field's unless ``default`` is given: ``argparse.SUPPRESS`` (``pdserve up``: only
    flags given override the deployment file) or a value that means the same (``None``
    for ``model``'s "")."""
    f = _FIELDS[name]
    flag, kind = flag_of(f), _scalar(_HINTS[name])
    kw: dict[str, object] = {"dest": name,
                             "default": f.default if default is _FIELD_DEFAULT else default}
    help = str(f.metadata["help"])
    if kind is bool:  # a switch: its flag turns the field's default around
        kw["action"] = "store_false" if f.default else "store_true"
    else:
        kw["type"] = kind
        choices = f.metadata["choices"] or CHOICES.get(name)
        if choices:
            kw["choices"] = choices
        elif flag != f"--{name.replace('_', '-')}":
            kw["metavar"] = flag.lstrip("-").replace("-", "_").upper()  # not the field's
        help += f" (default: {f.metadata['shown'] or f.default})"
    p.add_argument(flag, help=help, **kw)  # type: ignore[arg-type]


def add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """One flag per DeploymentConfig field, set only when given (``pdserve up``)."""
    for name in _FIELDS:
        add_setting(p, name, default=argparse.SUPPRESS)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    add_setting(p, "model", default=None)
    p.add_argument("--cache-dir", default=None,
                   help="where converted models live (default: $PDSERVE_CACHE_DIR or "
                        "~/.cache/pdserve)")
    add_setting(p, "dtype")
    add_setting(p, "kv_cache_dtype")
    add_setting(p, "quantization")
    add_setting(p, "kv_cache_gb")
    add_setting(p, "block_size")
    add_setting(p, "max_num_batched_tokens")
    add_setting(p, "prefill_tokens_while_decoding")
    add_setting(p, "max_model_len")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="torch threads for this process (default: all cores)")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N]: where weights, KV cache and the forward run "
                        "(KV transfer uses NCCL between CUDA workers)")


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags as EngineConfig fields (all but ``model``)."""
    cache = cache_dir(args)
    return {
        "kernel_cache_dir": str(cache / "kernels") if cache else None,
        "dtype": args.dtype,
        "kv_cache_memory_gb": args.kv_cache_gb,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": None if args.quantization == "none" else args.quantization,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prefill_tokens_while_decoding": args.prefill_tokens_while_decoding,
        "max_model_len": args.max_model_len,
        "num_threads": args.threads,
        "device": args.device,
    }


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="the router wants API keys: send the first key of this file (the "
                        "key alone, or `KEY TENANT ...` lines; default: $PDSERVE_API_KEY, "
                        "else no key); never a key on the command line")


def client_api_key(args: argparse.Namespace) -> str | None:
    """The key a client command sends: the first key of ``--api-key-file`` (a file with
    just the key, or a router's key file), else ``$PDSERVE_API_KEY``; read here, once, at
    the edge."""
    if getattr(args, "api_key_file", None):
        try:
            return read_key_file(args.api_key_file)[0]
        except OSError as e:
            raise SystemExit(f"pdserve: cannot read --api-key-file: {e.strerror}") from None
        except ValueError as e:
            raise SystemExit(f"pdserve: --api-key-file: {e}") from None
    return os.environ.get("PDSERVE_API_KEY") or None


def read_key_file(path: str) -> tuple[str, str]:
    """(first key, first admin key or else the first key) of a ``KEY TENANT [admin]`` file."""
    first: str | None = None
    admin: str | None = None
    for line in Path(path).read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        first = first or words[0]
        if admin is None and "admin" in words[2:]:
            admin = words[0]
    if first is None:
        raise ValueError(f"{path} holds no key (one `KEY TENANT [admin]` per line)")
    return first, admin or first
