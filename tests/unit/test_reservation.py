"""The decode side's reservation machine, alone: its whole table, both orders of the two
events that meet, abort in every state, and the offer timeout."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from workers.reservation import (
    PREFILL_FAILED,
    TRANSITIONS,
    Actions,
    IllegalTransition,
    ReservationEvent,
    ReservationMachine,
    ReservationState,
)

S, E = ReservationState, ReservationEvent
TOKEN = 42
Step = Callable[[ReservationMachine], object]


def place(m: ReservationMachine) -> None:
    m.place()


def commit(token: int | None) -> Step:
    return lambda m: m.commit(token)


def ended(ok: bool) -> Step:
    return lambda m: m.transfer_ended(ok)


def abort(m: ReservationMachine) -> Actions:
    return m.abort("the request was cancelled")


# How a fresh machine gets into each state by legal events. A state added to the machine
# without a path here fails test_every_state_has_a_path, and so every test below.
PATHS: dict[ReservationState, list[Step]] = {
    S.QUEUED: [],
    S.AWAITING: [place],
    S.COMMITTED: [place, commit(TOKEN)],
    S.TRANSFERRED: [place, ended(True)],
    S.CANCELLING: [place, abort],
    S.RUNNING: [place, commit(TOKEN), ended(True)],
    S.RECOMPUTING: [place, ended(False), commit(TOKEN)],
    S.LOCAL: [lambda m: m.go_local()],
    S.REJECTED: [lambda m: m.reject()],
    S.ABORTED: [abort],
}

# One call per event, for the product test (the cases below vary the arguments).
FIRE: dict[ReservationEvent, Step] = {
    E.PLACE: place,
    E.LOCAL: lambda m: m.go_local(),
    E.REJECT: lambda m: m.reject(),
    E.COMMIT: commit(TOKEN),
    E.TRANSFER_ENDED: ended(True),
    E.ABORT: abort,
}


def machine_in(state: ReservationState) -> ReservationMachine:
    m = ReservationMachine("r")
    for step in PATHS[state]:
        step(m)
    assert m.state is state
    return m


def test_every_state_has_a_path_and_every_event_a_call() -> None:
    assert set(PATHS) == set(S)
    assert set(FIRE) == set(E)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(S, E)),
                         ids=lambda x: x.value)
def test_every_state_event_pair_follows_the_table(state: ReservationState,
                                                  event: ReservationEvent) -> None:
    m = machine_in(state)
    before = (m.first_token, m.transfer_ok)
    if (state, event) in TRANSITIONS:
        FIRE[event](m)
        assert m.state in TRANSITIONS[state, event]
    else:
        with pytest.raises(IllegalTransition, match=f"{event.value} is not taken in state "
                                                    f"{state.value}"):
            FIRE[event](m)
        assert m.state is state and (m.first_token, m.transfer_ok) == before


@dataclass(frozen=True)
class Case:
    start: ReservationState
    event: ReservationEvent
    step: Step
    end: ReservationState
    actions: Actions | None = None  # None: the event returns nothing


OFFER_TIMER = Actions(arm_offer_timeout=True)
SETTLE = Actions(settle=True)
CANCEL = Actions(cancel_transfer="the request was cancelled")

CASES = [
    Case(S.QUEUED, E.PLACE, place, S.AWAITING),
    Case(S.QUEUED, E.LOCAL, lambda m: m.go_local(), S.LOCAL),
    Case(S.QUEUED, E.REJECT, lambda m: m.reject(), S.REJECTED),
    Case(S.QUEUED, E.ABORT, abort, S.ABORTED, Actions()),  # held nothing: nothing to settle
    Case(S.AWAITING, E.COMMIT, commit(TOKEN), S.COMMITTED, OFFER_TIMER),
    Case(S.AWAITING, E.COMMIT, commit(None), S.COMMITTED,
         Actions(cancel_transfer=PREFILL_FAILED)),
    Case(S.AWAITING, E.TRANSFER_ENDED, ended(True), S.TRANSFERRED, Actions()),
    Case(S.AWAITING, E.TRANSFER_ENDED, ended(False), S.TRANSFERRED, Actions()),
    Case(S.AWAITING, E.ABORT, abort, S.CANCELLING, CANCEL),
    Case(S.COMMITTED, E.TRANSFER_ENDED, ended(True), S.RUNNING, SETTLE),
    Case(S.COMMITTED, E.TRANSFER_ENDED, ended(False), S.RECOMPUTING, SETTLE),
    Case(S.COMMITTED, E.ABORT, abort, S.CANCELLING, CANCEL),
    Case(S.TRANSFERRED, E.COMMIT, commit(TOKEN), S.RUNNING, SETTLE),
    Case(S.TRANSFERRED, E.COMMIT, commit(None), S.RECOMPUTING, SETTLE),
    Case(S.TRANSFERRED, E.ABORT, abort, S.ABORTED, SETTLE),
    Case(S.CANCELLING, E.TRANSFER_ENDED, ended(True), S.ABORTED, SETTLE),
    Case(S.CANCELLING, E.TRANSFER_ENDED, ended(False), S.ABORTED, SETTLE),
    Case(S.CANCELLING, E.COMMIT, commit(TOKEN), S.CANCELLING, Actions()),
]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{c.start.value}-{c.event.value}-{c.end.value}")
def test_each_allowed_transition_does_what_the_lifecycle_says(case: Case) -> None:
    m = machine_in(case.start)
    assert case.step(m) == case.actions
    assert m.state is case.end


def test_the_cases_cover_every_allowed_transition() -> None:
    allowed = {(s, e, t) for (s, e), targets in TRANSITIONS.items() for t in targets}
    assert {(c.start, c.event, c.end) for c in CASES} == allowed


def test_the_table_has_an_exit_from_every_state_and_none_from_a_terminal_one() -> None:
    for (state, _), targets in TRANSITIONS.items():
        assert not state.terminal
        assert targets
    reachable, frontier = {S.QUEUED}, [S.QUEUED]
    while frontier:
        state = frontier.pop()
        for (s, _), targets in TRANSITIONS.items():
            if s is state:
                frontier += list(targets - reachable)
                reachable |= targets
    assert reachable == set(S)
    assert all(_ends(state) for state in S)  # every exit, followed far enough, ends


def _ends(state: ReservationState, seen: frozenset[ReservationState] = frozenset()) -> bool:
    if state.terminal:
        return True
    nexts = {t for (s, e), ts in TRANSITIONS.items() if s is state for t in ts}
    return any(_ends(t, seen | {state}) for t in nexts - seen - {state})


# -- the two events meet, in either order ------------------------------------------------

@pytest.mark.parametrize("landed", [True, False])
@pytest.mark.parametrize("first_token", [TOKEN, 0, None])
@pytest.mark.parametrize("commit_first", [True, False], ids=["commit-first", "transfer-first"])
def test_transfer_end_and_commit_settle_the_same_in_either_order(
        landed: bool, first_token: int | None, commit_first: bool) -> None:
    m = machine_in(S.AWAITING)
    events = [commit(first_token), ended(landed)]
    first, second = events if commit_first else events[::-1]
    assert not first(m).settle  # one event alone never settles
    assert second(m).settle
    want = S.RUNNING if landed and first_token is not None else S.RECOMPUTING
    assert m.state is want
    assert m.first_token == first_token and m.transfer_ok is landed


def test_a_failed_prefill_never_decodes_from_a_transfer_that_landed_anyway() -> None:
    m = machine_in(S.AWAITING)
    assert m.commit(None) == Actions(cancel_transfer=PREFILL_FAILED)
    assert m.transfer_ended(True) == SETTLE
    assert m.state is S.RECOMPUTING and m.first_token is None


# -- abort ---------------------------------------------------------------------------------

def test_abort_while_the_transfer_runs_frees_only_once_it_ended() -> None:
    for state in (S.AWAITING, S.COMMITTED):
        m = machine_in(state)
        actions = m.abort("the worker is failing every request")
        assert actions == Actions(cancel_transfer="the worker is failing every request")
        assert m.state is S.CANCELLING and not actions.settle
        assert m.commit(TOKEN) == Actions()  # a late commit changes nothing
        assert m.state is S.CANCELLING
        assert m.transfer_ended(True) == SETTLE  # even a landed transfer is freed
        assert m.state is S.ABORTED


def test_abort_after_the_transfer_ended_frees_at_once() -> None:
    m = machine_in(S.TRANSFERRED)
    assert abort(m) == SETTLE and m.state is S.ABORTED


def test_abort_while_queued_holds_nothing_to_settle() -> None:
    m = machine_in(S.QUEUED)
    assert abort(m) == Actions() and m.state is S.ABORTED


@pytest.mark.parametrize("state", [s for s in S if s.terminal] + [S.CANCELLING],
                         ids=lambda s: s.value)
def test_abort_twice_or_after_settling_is_a_bug(state: ReservationState) -> None:
    with pytest.raises(IllegalTransition):
        abort(machine_in(state))


# -- the offer timeout ---------------------------------------------------------------------

def test_commit_before_any_offer_arms_the_offer_timeout_which_recomputes() -> None:
    m = machine_in(S.AWAITING)
    assert m.commit(TOKEN) == OFFER_TIMER
    # The loop's timer cancels the still-PENDING transfer; it ends, not landed.
    assert m.transfer_ended(False) == SETTLE
    assert m.state is S.RECOMPUTING and m.first_token == TOKEN  # resumes after it


def test_commit_after_the_transfer_ended_arms_no_timer() -> None:
    m = machine_in(S.TRANSFERRED)
    actions = m.commit(TOKEN)
    assert not actions.arm_offer_timeout and actions.settle and m.state is S.RUNNING
