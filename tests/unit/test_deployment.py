"""The deployment file and the command lines every launcher derives from it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import pytest

from cluster.cli import build_parser, deployment_config, expand_config
from cluster.deployment import (
    KV_OFFERS,
    DeploymentConfig,
    DeploymentError,
    flag_of,
    load_yaml,
)
from workers.config import WorkerConfig
from workers.engine.params import EngineConfig

EXAMPLE = Path(__file__).parents[2] / "deploy" / "pdserve.yaml"


def test_the_example_file_loads_and_is_valid() -> None:
    config = DeploymentConfig(**load_yaml(EXAMPLE))  # type: ignore[arg-type]
    assert config.pool_sizes() == {"prefill": 1, "decode": 1, "mixed": 0}
    assert config.launcher == "ray" and config.strategy("prefill") == "PACK"


@pytest.mark.parametrize(("text", "message"), [
    ("prefil: 2\n", "unknown key 'prefil' (did you mean prefill"),
    ("prefill: two\n", "prefill: 'two' is not a <class 'int'>"),
    ("kv_cache_gb: true\n", "kv_cache_gb: True is not"),
    ("- 1\n- 2\n", "expected a mapping"),
])
def test_bad_files_are_refused_with_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(DeploymentError, match=re.escape(message)):
        load_yaml(path)


@pytest.mark.parametrize(("kw", "message"), [
    ({"prefill": 1}, "needs at least one of each"),
    ({"mixed": 0}, "no workers"),
    ({"prefill": 1, "decode": 1, "decode_strategy": "RANDOM"}, "decode_strategy"),
    ({"launcher": "k8s"}, "launcher"),
    ({"prefill": 1, "decode": 1, "decode_node_labels": "pool"}, "decode_node_labels"),
    ({"prefill": 1, "decode": 1, "prefill_node_labels": "a=1,a=2"}, "each key once"),
    ({"router_node_labels": "bad key=x"}, "router_node_labels"),
    ({"router_node_labels": "pool=bad value"}, "router_node_labels"),
    ({"router_node_labels": "pool=a=b"}, "router_node_labels"),
    ({"router_node_labels": "pool=-x"}, "router_node_labels"),
])
def test_configs_that_cannot_run_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(DeploymentError, match=message):
        DeploymentConfig(**kw)


def test_flags_override_the_file_and_unset_flags_keep_it(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("prefill: 2\ndecode: 2\nkv_cache_gb: 0.5\npolicy: round_robin\n")
    args = build_parser().parse_args(["up", "--config", str(path), "--decode", "3",
                                      "--no-redis", "--threads", "1"])
    config = deployment_config(args)
    assert (config.prefill, config.decode, config.kv_cache_gb) == (2, 3, 0.5)
    assert config.policy == "round_robin" and config.redis is False
    assert config.threads_per_worker == 1 and config.launcher == "ray"  # a default


def test_the_step_token_budget_reaches_every_worker_and_the_placement_rule() -> None:
    parser = build_parser()
    config = DeploymentConfig(prefill=1, decode=1, profile="/p.json", max_num_batched_tokens=512)
    for role in ("prefill", "decode", "mixed"):
        w = parser.parse_args(config.worker_args(role, "h", 0, None, 1))
        assert w.max_num_batched_tokens == 512
    assert parser.parse_args(config.router_args(["a:1"], None)).max_num_batched_tokens == 512
    with pytest.raises(DeploymentError, match="max-num-batched-tokens 0"):
        DeploymentConfig(max_num_batched_tokens=0)


def test_the_ttft_target_reaches_the_placement_rule() -> None:
    """``--slo-ttft-ms`` is the router's too: its placement rule keeps a prompt remote
    while the prefill workers would serve it in time (router/adaptive.py)."""
    parser = build_parser()
    targeted = DeploymentConfig(prefill=1, decode=1, profile="/p.json", slo_ttft_ms=450.0)
    assert parser.parse_args(targeted.router_args(["a:1"], None)).slo_ttft_ms == 450.0
    plain = DeploymentConfig(prefill=1, decode=1, profile="/p.json")
    assert parser.parse_args(plain.router_args(["a:1"], None)).slo_ttft_ms is None


def test_the_stall_free_cap_reaches_every_worker_and_survives_a_restart() -> None:
    from cluster.local import LocalCluster

    parser = build_parser()
    config = DeploymentConfig(mixed=2, prefill_tokens_while_decoding=192)
    for role in ("prefill", "decode", "mixed"):
        w = parser.parse_args(config.worker_args(role, "h", 0, None, 1))
        assert w.prefill_tokens_while_decoding == 192
    cluster = LocalCluster(config)  # nothing started: command lines only
    cluster.prefill_caps["worker-1"] = 64  # as SetRole set it live
    caps = [parser.parse_args(cluster._worker_args(i)).prefill_tokens_while_decoding
            for i in range(2)]
    assert caps == [192, 64]
    with pytest.raises(DeploymentError, match="prefill-tokens-while-decoding -1"):
        DeploymentConfig(prefill_tokens_while_decoding=-1)


def test_worker_and_router_command_lines_parse_as_the_cli_does() -> None:
    config = DeploymentConfig(prefill=1, decode=1, model="/m", max_model_len=512,
                              gpus_per_worker=1, drain_timeout_s=12, drain_grace_s=0.5,
                              stall_probe_s=2.0)
    parser = build_parser()
    w = parser.parse_args(config.worker_args("decode", "10.0.0.5", 0, "redis://r:6379/0", 4,
                                             metrics_port=0))
    assert (w.command, w.role, w.host, w.port, w.threads) == ("worker", "decode", "10.0.0.5",
                                                              0, 4)
    assert (w.redis_url, w.metrics_port, w.device, w.max_model_len, w.drain_timeout_s,
            w.drain_grace_s) == ("redis://r:6379/0", 0, "cuda", 512, 12.0, 0.5)
    with pytest.raises(DeploymentError, match="drain-grace-s -1"):
        DeploymentConfig(drain_grace_s=-1)
    with pytest.raises(DeploymentError, match="shorter than the timeout"):
        DeploymentConfig(drain_grace_s=5, drain_timeout_s=5)
    for profile in ("/p.json", None):  # the placement rule may come from a flag
        offered = DeploymentConfig(prefill=1, decode=1, profile=profile, kv_offer="after")
        assert parser.parse_args(offered.router_args(["a:1"], None)).kv_offer == "after"
    r = parser.parse_args(config.router_args(["a:1", "b:2"], None))
    assert (r.command, r.worker, r.metrics_port, r.policy) == ("router", ["a:1", "b:2"], 9400,
                                                               "cache_aware")
    assert r.stall_probe_s == 2.0 and r.kv_offer == "layers"
    with pytest.raises(DeploymentError, match="stall_probe_s"):
        DeploymentConfig(stall_probe_s=-1)
    assert w.kv_offer == "layers"  # the default, not on the line
    for offer in KV_OFFERS:
        args = DeploymentConfig(kv_offer=offer).worker_args("prefill", "h", 0, None, 1)
        assert parser.parse_args(args).kv_offer == offer
    with pytest.raises(DeploymentError, match="kv_offer"):
        DeploymentConfig(kv_offer="sometime")
    assert w.kv_offer_timeout_s == 60.0  # the default, not on the line
    args = DeploymentConfig(kv_offer_timeout_s=300).worker_args("decode", "h", 0, None, 1)
    assert parser.parse_args(args).kv_offer_timeout_s == 300.0
    for bad in (0, -1):
        with pytest.raises(DeploymentError, match="kv_offer_timeout_s must be > 0"):
            DeploymentConfig(kv_offer_timeout_s=bad)


def test_the_kv_offer_choices_are_the_channels() -> None:
    from common.cost_model import KV_OFFERS as MODEL_OFFERS
    from workers.transfer.channel import KV_OFFERS as CHANNEL_OFFERS

    assert KV_OFFERS == CHANNEL_OFFERS == MODEL_OFFERS


def test_roles_and_threads() -> None:
    config = DeploymentConfig(prefill=2, decode=1)
    assert config.roles() == [("prefill-0", "prefill"), ("prefill-1", "prefill"),
                              ("decode-0", "decode")]
    assert config.threads(cores=2) == 1 and config.threads(cores=12) == 4
    assert DeploymentConfig(threads_per_worker=3).threads(cores=64) == 3


def test_bare_up_is_one_prefill_and_one_decode_worker() -> None:
    parser = build_parser()
    assert deployment_config(parser.parse_args(["up"])).pool_sizes() == {
        "prefill": 1, "decode": 1, "mixed": 0}
    assert deployment_config(parser.parse_args(["up", "--mixed", "2"])).pool_sizes() == {
        "prefill": 0, "decode": 0, "mixed": 2}


def test_a_component_reads_its_settings_from_the_deployment_file(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("prefill: 1\ndecode: 1\nkv_cache_gb: 0.5\nredis_url: redis://r:1/0\n"
                    "threads_per_worker: 2\nmax_model_len: 256\npolicy: least_loaded\n")
    parser = build_parser()
    w = parser.parse_args(expand_config(["worker", "--config", str(path), "--role", "decode",
                                         "--port", "7000", "--kv-cache-gb", "2"]))
    assert (w.role, w.port, w.kv_cache_gb, w.redis_url, w.threads, w.max_model_len) == (
        "decode", 7000, 2.0, "redis://r:1/0", 2, 256)
    r = parser.parse_args(expand_config(["router", f"--config={path}", "--port", "1"]))
    assert (r.policy, r.redis_url, r.port, r.worker) == ("least_loaded", "redis://r:1/0", 1,
                                                         None)
    assert expand_config(["status", "--config", "x"]) == ["status", "--config", "x"]


def test_deploy_files_agree_with_the_package() -> None:
    """The image copies every package pyproject installs; the launcher YAML parses."""
    import tomllib
    import yaml

    root = Path(__file__).parents[2]
    packages = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    dockerfile = (root / "deploy" / "Dockerfile").read_text()
    for pkg in packages:
        name = pkg.rstrip("*")
        assert f"COPY {name} {name}" in dockerfile, f"deploy/Dockerfile misses {name}/"
    launcher = yaml.safe_load((root / "deploy" / "ray-cluster.yaml").read_text())
    assert launcher["provider"]["type"] == "local" and launcher["head_start_ray_commands"]


def _command(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _actions(command: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _command(command)._actions}


def test_every_setting_has_an_up_flag_with_its_default_and_help() -> None:
    """``pdserve up``'s flags are built from DeploymentConfig's fields: one per field,
    named by it, its help stating the field's default (a switch flips it)."""
    up = _actions("up")
    for f in dataclasses.fields(DeploymentConfig):
        action = up[f.name]
        assert action.option_strings == [flag_of(f)] and action.help, f.name
        assert action.default is argparse.SUPPRESS, f"{f.name}: a file's value must win"
        if f.default is True:
            assert flag_of(f) == f"--no-{f.name.replace('_', '-')}", f.name
        elif not isinstance(f.default, bool):
            shown = f.metadata["shown"] or f.default
            assert action.help.endswith(f"(default: {shown})"), (f.name, action.help)


def _other_value(f: dataclasses.Field, action: argparse.Action) -> tuple[list[str], object]:
    """A command line giving field ``f`` a value other than its default, and the value."""
    if action.nargs == 0:  # a switch
        return [flag_of(f)], not f.default
    if action.choices:
        value = next(c for c in action.choices if c != f.default)
        return [flag_of(f), value], value
    if f.name.endswith("_node_labels"):  # KEY=VALUE: "/x" is no label
        return [flag_of(f), "pdserve.io/pool=x"], "pdserve.io/pool=x"
    value = {int: 7, float: 0.25 if f.default == 0.5 else 0.5, str: "/x"}[action.type or str]
    return [flag_of(f), str(value)], value


def test_each_up_flag_sets_its_field() -> None:
    up = _actions("up")
    parser = build_parser()
    # a grace below any timeout the loop sets (the flag given again wins)
    base = ["up", "--prefill", "1", "--decode", "1", "--drain-grace-s", "0.1"]
    for f in dataclasses.fields(DeploymentConfig):
        choices = up[f.name].choices
        if choices is not None and len(choices) == 1:  # nothing else to set it to
            assert f.default in choices
            continue
        argv, value = _other_value(f, up[f.name])
        config = deployment_config(parser.parse_args(base + argv))
        assert getattr(config, f.name) == value != f.default, (f.name, argv)


ENGINE = ["model", "dtype", "kv_cache_gb", "block_size", "max_num_batched_tokens",
          "max_model_len"]


@pytest.mark.parametrize(("command", "shared"), [
    ("worker", [*ENGINE, "local_prefill_threshold", "transfer_timeout_s", "drain_timeout_s",
                "drain_grace_s", "cluster_tls_dir", "cluster_secret_file"]),
    ("router", ["policy", "port", "http_port", "max_in_flight", "cluster_tls_dir", "tls_cert",
                "tls_key", "profile", "itl_budget_ms", "slo_ttft_ms",
                "max_num_batched_tokens"]),
    ("generate", ENGINE),
])
def test_components_share_the_deployment_defaults_and_help(command: str,
                                                           shared: list[str]) -> None:
    """A setting ``pdserve worker``/``router``/``generate`` share with the deployment has
    its flag, default and help from the field, so ``pdserve up`` and a bare component
    agree."""
    up, own = _actions("up"), _actions(command)
    fields = {f.name: f for f in dataclasses.fields(DeploymentConfig)}
    for name in shared:
        assert own[name].option_strings == up[name].option_strings, name
        assert own[name].help == up[name].help and own[name].choices == up[name].choices, name
        expected = None if name == "model" else fields[name].default  # None: the default model
        assert own[name].default == expected, name


def test_a_file_without_pools_gives_components_the_pools_up_would_run(tmp_path: Path) -> None:
    """``pdserve worker --config`` splits the cores as ``pdserve up --config`` would:
    no pool size in the file is one prefill and one decode worker, not one mixed."""
    path = tmp_path / "d.yaml"
    path.write_text("kv_cache_gb: 0.5\n")
    up = deployment_config(build_parser().parse_args(["up", "--config", str(path)]))
    assert up.pool_sizes() == {"prefill": 1, "decode": 1, "mixed": 0}
    w = build_parser().parse_args(expand_config(["worker", "--config", str(path)]))
    assert w.threads == up.threads(os.cpu_count() or 1) and w.kv_cache_gb == 0.5


def test_autoscale_needs_a_profile_and_the_process_launcher() -> None:
    with pytest.raises(DeploymentError, match="--profile"):
        DeploymentConfig(autoscale=True, launcher="process").check_autoscale()
    with pytest.raises(DeploymentError, match="launcher process"):
        DeploymentConfig(autoscale=True, profile="p.json").check_autoscale()
    DeploymentConfig(autoscale=True, profile="p.json", launcher="process").check_autoscale()


def test_autoscaled_workers_publish_their_steps_to_the_planner() -> None:
    """The live planner refits its step model from the workers' served steps, which they
    publish to Redis (``--publish-steps``) only when it runs; the worker refuses the
    flag without a Redis."""
    parser = build_parser()
    auto = DeploymentConfig(autoscale=True, profile="p.json", launcher="process")
    w = parser.parse_args(auto.worker_args("mixed", "h", 0, "redis://r:6379/0", 1))
    assert w.publish_steps
    assert "--publish-steps" not in auto.worker_args("mixed", "h", 0, None, 1)
    assert "--publish-steps" not in DeploymentConfig().worker_args("mixed", "h", 0,
                                                                   "redis://r:6379/0", 1)
    with pytest.raises(ValueError, match="redis_url"):
        WorkerConfig(EngineConfig(model="m"), "m", publish_steps=True)
    assert WorkerConfig(EngineConfig(model="m"), "m", redis_url="redis://r:6379/0",
                        publish_steps=True).publish_steps


def test_node_labels_read_as_ray_label_selectors() -> None:
    config = DeploymentConfig(prefill=1, decode=1, prefill_node_labels="pdserve.io/pool=prefill",
                              decode_node_labels=" zone=b , pdserve.io/pool=!prefill")
    assert config.labels("prefill") == {"pdserve.io/pool": "prefill"}
    assert config.labels("decode") == {"zone": "b", "pdserve.io/pool": "!prefill"}
    assert config.labels("mixed") == {} and config.labels("router") == {}
    args = build_parser().parse_args(["up", "--prefill", "1", "--decode", "1",
                                      "--decode-node-labels", "zone=b"])
    assert deployment_config(args).labels("decode") == {"zone": "b"}


def test_status_counts_the_nodes_a_label_selector_matches() -> None:
    from cluster.ray_cluster import _matches

    node = {"pdserve.io/pool": "decode", "zone": "b"}
    assert _matches(node, {}) and _matches(node, {"pdserve.io/pool": "decode"})
    assert _matches(node, {"pdserve.io/pool": "!prefill", "zone": "b"})
    assert not _matches(node, {"pdserve.io/pool": "!decode"})
    assert not _matches(node, {"rack": "r1"}) and _matches(node, {"rack": "!r1"})
