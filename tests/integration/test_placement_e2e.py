"""The router's live prefill placement (router/adaptive.py) on real processes: with a
machine profile whose KV link is hopeless (10 s per transfer), every disaggregated prompt
is computed on the decode worker that reserved it (the router commits without a first
token), token-exact, counted by reason, and no block leaks; without a profile the same
cluster shape sends every prompt to the prefill worker."""

from __future__ import annotations

import urllib.request

import pytest
from cluster_helpers import assert_cluster_idle, start
from conftest import hf_greedy

from common.cost_model import save_profile
from planner.synthetic import synthetic_profile
from router.client import Client

MAX_TOKENS = 5
PROMPTS = [[(13 * i + j) % 230 + 7 for j in range(40 + 8 * i)] for i in range(4)]


@pytest.fixture(scope="module", params=["hopeless-link", "no-profile"])
def placed(request, tiny_checkpoints, tmp_path_factory):
    logs = tmp_path_factory.mktemp(request.param)
    kw = {}
    if request.param == "hopeless-link":
        profile = logs / "profile.json"
        save_profile(synthetic_profile("cpu", latency_s=10.0), profile)
        kw["profile"] = str(profile)
    c = start(tiny_checkpoints["llama"], logs, prefill=1, decode=1, threads_per_worker=1,
              block_size=4, local_prefill_threshold=0, **kw)
    yield request.param, c
    c.stop()


def test_prompts_go_where_the_rule_says_and_come_back_exact(placed, tiny_checkpoints):
    kind, c = placed
    with Client(c.target) as client:
        got = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
               for p in PROMPTS]
    assert [g.token_ids for g in got] == hf_greedy(tiny_checkpoints["llama"], PROMPTS,
                                                  MAX_TOKENS)
    reasons = {g.routing["reason"] for g in got}
    metrics = urllib.request.urlopen(c.metrics_urls["router"], timeout=5).read().decode()
    if kind == "hopeless-link":
        assert reasons == {"local_idle"}, reasons
        assert 'prefill_placement_total{model="llama",reason="idle",where="local"} 4.0' in metrics
    else:
        assert "local_idle" not in reasons and "local" not in reasons
        assert "prefill_placement_total{" not in metrics
    assert_cluster_idle(c)
