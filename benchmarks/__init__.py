"""Every benchmark of pdserve, one module each, run through ``pdserve bench-*``.

Top layer beside :mod:`cluster`'s launchers: a benchmark may import anything below it
(it starts clusters, engines and channels), and nothing but the CLI imports it. Each one
runs our path and its baseline in the same run and prints workload, machine and ratio.

- :mod:`benchmarks.engine`: the engine against Hugging Face ``generate`` and a GEMM floor;
- :mod:`benchmarks.transfer`: the bare KV channel against raw TCP;
- :mod:`benchmarks.disagg`: disaggregated TTFT against colocated;
- :mod:`benchmarks.multinode`: the KV channel against raw TCP across a veth link between
  test hosts, and TTFT / the first-to-second-token gap under link conditions;
- :mod:`benchmarks.router`: the router's overhead per request;
- :mod:`benchmarks.routing`: cache-aware routing against round robin;
- :mod:`benchmarks.headline`: 1 prefill + 1 decode against 2 mixed under load;
- :mod:`benchmarks.serving`: pdserve against vLLM on one OpenAI workload, and where
  pdserve's CPU time per token goes (:mod:`benchmarks.serving_profile`);
- :mod:`benchmarks.external_harness`: ``pdserve bench`` against guidellm, aiperf and
  ``vllm bench serve`` on one server (:mod:`benchmarks.external_tools` runs and reads them);
- :mod:`benchmarks.choices`: n choices of one prompt against one request per choice;
- :mod:`benchmarks.structured`: structured-output decoding against unconstrained.
"""
