"""Where a disaggregated request's prompt is computed: on a prefill worker, or on the
decode worker that already holds its reservation. Pure logic, no I/O.

The static rule (conditional disaggregation, as every peer ships it) looks only at the
prompt: an uncached part shorter than ``static_threshold`` is prefilled locally. With a
machine profile (:mod:`common.cost_model`, written by ``pdserve profile``) the rule also
weighs the live state the router sees, per request, after the decode worker reserved
blocks and said how much of the prompt it already caches:

- **remote**: wait for the least-loaded prefill worker's queue (its queued uncached
  tokens, as one prefill), compute the uncached part there, move its KV
  (``uncached x kv_bytes_per_token`` over the profiled link; under the prefill workers'
  ``kv_offer``, ``layers`` by default, it moves while the step that computes the
  prompt's last chunk runs: :meth:`~common.cost_model.TransferModel.landed_s`), then the
  decode worker admits it at its next step boundary (one decode step of its batch);
- **local**: the decode worker computes the prompt inside its own steps, a chunk of up
  to its spare step budget (``max_num_batched_tokens`` minus its running decodes) per
  step, each step then taking the mixed batch's time.

Local wins when it brings the first token at least ``local_gain`` sooner (a prompt
computed locally takes the decode worker's next steps, which remote keeps free for the
requests arriving after it) *and* the step it makes the running decodes wait through
stays within ``itl_budget_s`` (with nothing running, nobody waits, and the rest does
not apply) *and*, given the TTFT target ``ttft_slo_s``, remote would not bring the
first token within ``ttft_share`` of it: a prompt the prefill workers serve in time is
not worth a stall of every running decode (the multi-turn chat of ``pdserve
bench-headline``, whose prompts each stall a 1-thread Xeon decode worker 150-250 ms,
otherwise pays it in ITL p99 at no gain in goodput); below the target, local is for
the prompts remote would make late.

Reasons, for the ``prefill_placement_total`` metric (and, when local, the response's
routing block): ``short`` (below the static threshold), ``idle`` / ``spare`` (local: an
idle decode worker / a step within the budget), ``queue`` (remote, though local would
be sooner: the stall would break the budget), ``slo`` (remote, though local would be
sooner: remote meets the TTFT target), ``remote`` (remote is sooner).

The planner's simulator (:mod:`planner.sim`) runs this same rule for its ``adaptive``
candidate, so what ``pdserve plan`` predicts is what the router does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.cost_model import KV_OFFERS, Profile

TTFT_SHARE = 0.5
"""The share of the TTFT target a remote prompt's estimated TTFT may take and still go
remote when local would be sooner: the estimate is the model's time alone (tokenizing,
the reservation's round trip, the router's queue and the step times' spread are not in
it), and half of the target is left for them."""


@dataclass(frozen=True)
class PlacementInputs:
    """What the router knows when it places one prompt."""

    uncached_tokens: int
    """Prompt tokens the decode worker does not cache (it said so in its reservation)."""
    cached_tokens: int = 0
    decode_running: int = 0
    """Requests the decode worker is already decoding (this router's streams there)."""
    decode_context_tokens: int = 0
    """Their total context (prompt + generated so far), as this router counted it."""
    prefill_queued_tokens: int = 0
    """The least uncached prompt tokens queued on any serving prefill worker."""


@dataclass(frozen=True)
class Estimate:
    local_s: float
    remote_s: float
    stall_s: float
    """How long one step of the decode worker takes while it computes the prompt."""


class PrefillPlacement:
    """The rule; see the module docstring. Immutable, so one instance serves every
    request of the router (and every simulated request of the planner)."""

    def __init__(self, profile: Profile | None, decode_threads: int = 1,
                 prefill_threads: int = 1, itl_budget_s: float = 0.2,
                 static_threshold: int = 32, local_gain: float = 0.2,
                 kv_offer: str = "layers", ttft_slo_s: float | None = None,
                 ttft_share: float = TTFT_SHARE) -> None:
        if kv_offer not in KV_OFFERS:
            raise ValueError(f"unknown kv_offer {kv_offer!r}: one of {', '.join(KV_OFFERS)}")
        if not 0 <= local_gain < 1:
            raise ValueError(f"local_gain must be in [0, 1), got {local_gain}")
        if itl_budget_s <= 0:
            raise ValueError(f"itl_budget_s must be > 0, got {itl_budget_s}")
        if static_threshold < 0:
            raise ValueError(f"static_threshold must be >= 0, got {static_threshold}")
        if ttft_slo_s is not None and ttft_slo_s <= 0:
            raise ValueError(f"ttft_slo_s must be > 0 (None: no target), got {ttft_slo_s}")
        if not 0 < ttft_share <= 1:
            raise ValueError(f"ttft_share must be in (0, 1], got {ttft_share}")
        self.profile = profile
        self.itl_budget_s = itl_budget_s
        self.static_threshold = static_threshold
        self.local_gain = local_gain
        self.kv_offer = kv_offer
        self.remote_within_s = ttft_slo_s * ttft_share if ttft_slo_s else None
        """Remote's estimate at most this: remote (the TTFT target, less a margin for
        what the estimate leaves out: the router, the reservation, queueing jitter)."""
        self._decode = profile.step(decode_threads) if profile else None
        self._prefill = profile.step(prefill_threads) if profile else None

    @property
    def adaptive(self) -> bool:
        return self.profile is not None

    def estimate(self, x: PlacementInputs) -> Estimate:
        assert self.profile is not None and self._decode and self._prefill
        p, dec, pre = self.profile, self._decode, self._prefill
        ctx = x.decode_context_tokens // x.decode_running if x.decode_running else 0
        batch = [(1, ctx)] * x.decode_running
        decode_step = dec.seconds(batch) if batch else 0.0
        queue = pre.prefill_seconds(x.prefill_queued_tokens) if x.prefill_queued_tokens else 0.0
        # The prefill worker computes the prompt in chunks of its step budget; its KV goes
        # out during (layers) or after the last chunk's step, all of it at once.
        last = (x.uncached_tokens - 1) % p.max_num_batched_tokens + 1
        earlier = x.uncached_tokens - last
        before = pre.prefill_seconds(earlier, x.cached_tokens) if earlier else 0.0
        remote = (queue + before
                  + p.transfer.landed_s(x.uncached_tokens * p.kv_bytes_per_token,
                                        pre.prefill_seconds(last, x.cached_tokens + earlier),
                                        self.kv_offer)
                  + decode_step)
        budget = max(1, p.max_num_batched_tokens - x.decode_running)
        chunk = min(x.uncached_tokens, budget)
        stall = dec.seconds([*batch, (chunk, x.cached_tokens)])
        # Half a step to reach the running step's end, then every chunk's step.
        local = decode_step / 2 + math.ceil(x.uncached_tokens / budget) * stall
        return Estimate(local, remote, stall if batch else 0.0)

    def decide(self, x: PlacementInputs) -> tuple[bool, str]:
        """``(local, reason)`` for one prompt."""
        if x.uncached_tokens < self.static_threshold:
            return True, "short"
        if not self.adaptive:
            return False, "remote"
        e = self.estimate(x)
        if e.local_s > (1 - self.local_gain) * e.remote_s:
            return False, "remote"
        if x.decode_running == 0:
            return True, "idle"
        if self.remote_within_s is not None and e.remote_s <= self.remote_within_s:
            return False, "slo"
        if e.stall_s <= self.itl_budget_s:
            return True, "spare"
        return False, "queue"
