"""Incremental detokenization: multi-byte characters, stop strings split across tokens."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from workers.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tiny_checkpoints: dict[str, Path]):
    return AutoTokenizer.from_pretrained(tiny_checkpoints["tokenizer"])


def stream(tok, text: str, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tok("Say:").input_ids
    d = IncrementalDetokenizer(tok, prompt, **kw)
    deltas = [d.add(t) for t in tok(text, add_special_tokens=False).input_ids]
    deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", [" plain ascii words here", " héllo 日本語 ✓ 🙂 done", " a\nb  c"])
def test_deltas_concatenate_to_the_text(tok, text: str) -> None:
    deltas, d = stream(tok, text)
    assert "".join(deltas) == d.text == text
    assert not any("\ufffd" in x for x in deltas)


def test_stop_string_cuts_the_text_even_across_tokens(tok) -> None:
    deltas, d = stream(tok, " one two STOP three", stop=("STOP",))
    assert d.text == " one two " and "".join(deltas) == d.text and d.stopped_by == "STOP"
    deltas, d = stream(tok, " one two STOP three", stop=("STOP",),
                       include_stop_str_in_output=True)
    assert d.text == " one two STOP" and "".join(deltas) == d.text


def test_stop_strings_are_ignored_before_min_tokens(tok) -> None:
    n_early = len(tok(" STOP", add_special_tokens=False).input_ids)
    _, d = stream(tok, " STOP one STOP two", stop=("STOP",), min_tokens=n_early)
    assert d.text == " STOP one " and d.stopped_by == "STOP"
    _, d = stream(tok, " STOP one STOP two", stop=("STOP",), min_tokens=n_early - 1)
    assert d.text == " " and d.stopped_by == "STOP"


def test_flush_keeps_an_incomplete_final_character(tok) -> None:
    ids = tok(" ok 🙂", add_special_tokens=False).input_ids
    assert len(ids) > 2
    for cut in range(1, len(ids) + 1):
        d = IncrementalDetokenizer(tok, tok("Say:").input_ids)
        text = "".join(d.add(t) for t in ids[:cut]) + d.flush()
        assert text == d.text == tok.decode(ids[:cut])


def test_the_backend_decode_gives_what_the_tokenizer_decode_gives(tok) -> None:
    """The fast path (the Rust tokenizer's decode, skipping transformers' wrapper) is
    taken for this tokenizer and agrees with ``tok.decode`` on random windows, special
    tokens and partial characters included; a tokenizer that cleans up spaces keeps the
    wrapper."""
    import random

    from workers.engine.detokenizer import _backend_decode

    fast = _backend_decode(tok)
    assert fast is not None
    rng = random.Random(0)
    ids = tok(" héllo 日本語 🙂 the end", add_special_tokens=False).input_ids
    windows = [ids[i:j] for i in range(len(ids)) for j in range(i, len(ids) + 1)]
    windows += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 9))]
                for _ in range(300)]
    windows += [[tok.eos_token_id, *ids[:3], tok.bos_token_id]]
    for w in windows:
        assert fast(w, skip_special_tokens=True) == tok.decode(w, skip_special_tokens=True), w
    tok.clean_up_tokenization_spaces = True
    try:
        assert _backend_decode(tok) is None
    finally:
        tok.clean_up_tokenization_spaces = False
