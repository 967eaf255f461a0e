"""Is this Ray cluster closed to strangers? Ray runs any code a client sends it, so
``pdserve up`` places work only on a cluster that enforces Ray's token authentication
(Ray 2.52+, ``RAY_AUTH_MODE=token`` on every node; Ray 2.60 turns it on for a fresh
local cluster and keeps the token in ``~/.ray/auth_token``).

A client cannot learn the cluster's mode from its own settings: a client with a token
connects to a cluster without authentication just as well. So :func:`token_auth_enforced`
asks the GCS directly: one cheap call (``GetClusterId``) over a bare gRPC channel,
without Ray's interceptors and so without a token. A cluster that enforces tokens
answers UNAUTHENTICATED; one that answers the call lets anyone in.
"""

from __future__ import annotations

import os

AUTH_MODE_ENV = "RAY_AUTH_MODE"


def use_token_auth() -> None:
    """Token authentication for this process and the Ray daemons it starts. Ray takes
    the mode from ``RAY_AUTH_MODE`` only, and reads it into its config once, on import;
    setting the variable later needs the config re-read, which is what Ray does itself
    when it turns token auth on for a fresh cluster (``_enable_token_auth``)."""
    os.environ[AUTH_MODE_ENV] = "token"
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:  # another Ray: the GCS probe after ray.init still checks the result
        return
    _enable_token_auth()


class RayAuthError(RuntimeError):
    """The Ray cluster does not enforce token authentication (or could not be asked)."""


def token_auth_enforced(gcs_address: str, timeout_s: float = 10.0) -> bool:
    """Whether the Ray GCS at ``gcs_address`` refuses a call that carries no token: one
    ``GetClusterId`` over a bare gRPC channel. Raises :class:`RayAuthError` when the
    GCS cannot be asked (unreachable, or TLS)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # type: ignore[attr-defined]
                return True
            raise RayAuthError(
                f"could not ask the Ray GCS at {gcs_address} whether it requires a token: "
                f"{e.code().name} {e.details()}") from e  # type: ignore[attr-defined]
    return False


def require_token_auth(gcs_address: str) -> None:
    """Raise :class:`RayAuthError`, saying what to do, unless the GCS at
    ``gcs_address`` refuses calls without the token."""
    if not token_auth_enforced(gcs_address):
        raise RayAuthError(
            f"the Ray cluster at {gcs_address} does not use token authentication: anyone "
            "who reaches its ports can run code on every node. Restart it with "
            "RAY_AUTH_MODE=token on every node (`ray get-auth-token --generate`, then "
            "`RAY_AUTH_MODE=token ray start ...`; on KubeRay, the chart's kuberay.auth), "
            "and run `pdserve up` with RAY_AUTH_MODE=token too; or pass "
            "--allow-unauthenticated-ray if no one else can reach its network")
