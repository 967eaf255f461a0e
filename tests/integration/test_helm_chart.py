"""The Helm chart, rendered by a real ``helm`` and checked against the Kubernetes schemas.

For the default, GPU, KubeRay, external-Redis and autoscaling/ServiceMonitor values:
``helm lint --strict`` passes, ``helm template`` renders, and every object validates
against Kubernetes 1.37's schemas offline (``kubernetes-validate``, strict: no unknown
fields). The CRD objects (RayCluster, ServiceMonitor) have no schema there: their pod
templates are validated as Pods and their required fields checked. Bad values are
refused with the key and the rule. The rendered worker, router and ``pdserve up``
command lines are parsed by the CLI's own parser against the rendered deployment file.
Without helm (and no npm to fetch it) or kubernetes-validate, the tests skip and say why.
"""

from __future__ import annotations

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
               "--set", "metrics.serviceMonitor.enabled=true", "--set", "router.replicas=2"],
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
    if name == "kuberay":
        assert "RayCluster" in kinds and "Deployment" not in kinds
    else:
        assert kinds.count("Deployment") >= 3 and "RayCluster" not in kinds
    if name == "external-redis":
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


@pytest.mark.parametrize("name", ["default", "gpu", "external-redis", "scaled"])
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
            assert args.redis_url.startswith("redis://")
            assert any(e["name"] == "POD_IP" for e in c["env"])
        else:
            assert args.command == "router" and args.redis_url.startswith("redis://")
            assert (args.host, args.port, args.http_port, args.metrics_port) == (
                "0.0.0.0", 50051, 8000, 9400)
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
    (["--set", "redis.externalUrl=http://cache:6379"], "/redis/externalUrl"),
    (["--set", "pools.prefill.gpus=-1"], "/pools/prefill/gpus"),
    (["--set", "pools.prefil.replicas=2"], "additional properties 'prefil' not allowed"),
    (["--set", "pools.prefill.replicas=0"], "a disaggregated deployment needs both pools"),
    (["--set", "pools.prefill.replicas=0", "--set", "pools.decode.replicas=0"],
     "pools: no workers"),
    (["--set", "redis.enabled=false"], "routers find workers through the Redis registry"),
    (["--set", "pools.decode.autoscaling.metric=gpu"], "/pools/decode/autoscaling/metric"),
])
def test_bad_values_are_refused_with_the_key(helm: str, args: list[str], message: str) -> None:
    r = render(helm, *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
