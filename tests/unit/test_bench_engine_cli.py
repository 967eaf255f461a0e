"""``pdserve bench-engine``'s flags: a bad ``--profile-batches`` is refused before any model
loads, with the flag, what it takes and what was given."""

from __future__ import annotations

import pytest

from cluster.cli import main
from cluster.cli.bench import _positive_ints
from cluster.cli.options import EXIT_INVALID


@pytest.mark.parametrize(("text", "parsed"), [
    ("1,32,256", (1, 32, 256)), ("8", (8,)), ("0,8", None), ("8,", None), ("", None),
    ("a,2", None), ("-1", None),
])
def test_profile_batches_are_positive_integers(text: str, parsed: tuple | None) -> None:
    assert _positive_ints(text) == parsed


def test_a_bad_profile_batch_is_refused_with_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-engine", "--profile-batches", "16,0"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "--profile-batches" in err and "'16,0'" in err and "at least 1" in err
