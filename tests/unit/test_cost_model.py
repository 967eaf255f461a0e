"""common.cost_model: a linear spline in batched tokens plus attention pairs and sequences,
fitted by least squares, its held-out error, and the profile file's round trip."""

import dataclasses
import random

import pytest

from common.cost_model import (
    GEMV_ROWS,
    KNOTS,
    KV_OFFERS,
    PROFILE_VERSION,
    FitError,
    Profile,
    StepPoint,
    TransferModel,
    features,
    fit_steps,
    fit_transfer,
    knots,
    load_profile,
    refit_profile,
    save_profile,
)


def _true_step(chunks):
    """A made-up machine: 20 ms floor for up to 16 tokens, then 0.5 ms/token, attention
    2e-7 s per query x key pair, 0.1 ms per sequence."""
    t = sum(n for n, _ in chunks)
    a = sum(n * (s + (n + 1) / 2) for n, s in chunks)
    return 0.020 + 0.0005 * max(0, t - 16) + 2e-7 * a + 1e-4 * len(chunks)


def _points(n, seed=0, noise=0.0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            chunks = [(1, rng.randint(16, 1024))] * rng.randint(1, 64)
        else:
            chunks = [(rng.randint(16, 1024), rng.choice((0, 128, 512)))]
        y = _true_step(chunks) * (1 + rng.uniform(-noise, noise))
        out.append(StepPoint(tuple(chunks), y))
    return out


def test_features_count_tokens_attention_pairs_by_kernel_and_sequences():
    row = features([(1, 99), (4, 0), (3, 10)])
    assert row[0] == 1.0 and row[1] == 8.0
    all_knots = knots()
    assert all_knots == (GEMV_ROWS, *KNOTS)  # the slope may turn at the handover too
    assert row[2:2 + len(all_knots)] == [max(0.0, 8.0 - k) for k in all_knots]
    assert row[2 + len(all_knots)] == 1.0  # 8 tokens: past the decode GEMV
    decode, fresh, prefix, seqs = row[-4:]
    assert decode == 1 * (99 + 1)
    assert fresh == 4 * (0 + 2.5)
    assert prefix == 3 * (10 + 2)
    assert seqs == 3.0


def test_fit_recovers_a_piecewise_linear_machine_and_reports_held_out_error():
    m = fit_steps(_points(200, noise=0.0))
    assert m.error is not None and m.error.held_out == 40
    assert m.error.max_pct < 0.5
    for chunks in ([(1, 300)] * 8, [(700, 256)], [(1, 100)] * 4 + [(200, 0)]):
        assert m.seconds(chunks) == pytest.approx(_true_step(chunks), rel=0.01)


def test_the_gemv_handover_is_a_step_at_the_engines_gemv_rows():
    from workers.models.linear import GEMV_ROWS as ENGINE_GEMV_ROWS

    assert GEMV_ROWS == ENGINE_GEMV_ROWS  # the cost model's copy of the engine's number
    handover = 2 + len(knots())
    assert [features([(1, 50)] * b)[handover] for b in (1, GEMV_ROWS, GEMV_ROWS + 1, 64)] \
        == [0.0, 0.0, 1.0, 1.0]
    assert features([(GEMV_ROWS + 1, 0)])[handover] == 1.0  # counted in tokens, not sequences

    def machine(chunks):  # a made-up machine whose GEMM path costs 15 ms more than the GEMV
        t = sum(n for n, _ in chunks)
        return _true_step(chunks) + (0.015 if t > GEMV_ROWS else 0.0)

    rng = random.Random(3)
    shapes = [[(1, rng.randint(16, 1024))] * rng.randint(1, 12) for _ in range(80)]
    m = fit_steps([StepPoint(tuple(c), machine(c)) for c in shapes])
    for b in (2, GEMV_ROWS, GEMV_ROWS + 1, 8):
        assert m.decode_seconds(b, 300) == pytest.approx(machine([(1, 300)] * b), rel=0.01)


def test_a_model_puts_the_handover_where_its_engine_measured_it(tmp_path):
    """An engine whose GEMV stops at 2 rows (bf16 on a Zen 4): fitted with that, the
    handover step and the GEMV's own slope sit at 2, and the profile keeps it."""
    def machine(chunks):  # the GEMV: 4 ms a row; the GEMM past 2 rows: flat, then 0.5 ms
        t = sum(n for n, _ in chunks)
        gemv = 0.004 * t if t <= 2 else 0.0
        return _true_step(chunks) + gemv + (0.010 if t > 2 else 0.0)

    rng = random.Random(5)
    shapes = [[(1, rng.randint(16, 1024))] * rng.randint(1, 12) for _ in range(80)]
    points = [StepPoint(tuple(c), machine(c)) for c in shapes]
    m = fit_steps(points, gemv_rows=2)
    assert m.gemv_rows == 2 and features([(1, 9)] * 3, 2)[2 + len(knots(2))] == 1.0
    for b in (1, 2, 3, 4, 8):
        assert m.decode_seconds(b, 300) == pytest.approx(machine([(1, 300)] * b), rel=0.01)
    at_four = fit_steps(points)  # the default handover misplaces it
    assert max(abs(at_four.decode_seconds(b, 300) / machine([(1, 300)] * b) - 1)
               for b in (1, 2, 3, 4, 8)) > 0.02
    # scaled and per-sequence models keep it; a saved profile and a refit too
    assert m.scaled_parts(1.2, 1.1).gemv_rows == m.plus_per_sequence(0.001).gemv_rows == 2
    p = Profile("m", "bfloat16", {}, 16, 1024, 1000, 2048, 256, 2048, {1: m},
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]),
                points={"steps": {"1": [[[list(c) for c in q.chunks], q.seconds]
                                        for q in points]},
                        "transfer": [[1 << 20, 0.001], [1 << 24, 0.008], [1 << 22, 0.003]]})
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").steps[1].gemv_rows == 2
    assert refit_profile(tmp_path / "p.json").steps[1].gemv_rows == 2


def test_noise_shows_in_the_held_out_error():
    m = fit_steps(_points(300, noise=0.1))
    assert 1.0 < m.error.mean_pct < 10.0
    assert m.error.p90_pct >= m.error.mean_pct


def test_too_few_points_is_a_clear_error():
    with pytest.raises(ValueError, match="at least"):
        fit_steps(_points(3))


def test_transfer_fit_is_latency_plus_bytes_over_bandwidth():
    pts = [(b, 0.002 + b / 2.5e9) for b in (1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26) * 3]
    t = fit_transfer(pts)
    assert t.latency_s == pytest.approx(0.002, rel=0.01)
    assert t.bytes_per_s == pytest.approx(2.5e9, rel=0.01)
    assert t.seconds(1 << 25) == pytest.approx(0.002 + (1 << 25) / 2.5e9, rel=0.01)


def test_kv_lands_by_the_prefill_workers_offer():
    t = TransferModel(0.002, 1e9)
    # layers: the bytes move during the step, and cannot all be there before it ends
    assert t.landed_s(10**8, 0.5, "layers") == pytest.approx(0.5 + 0.002)
    assert t.landed_s(10**9, 0.5, "layers") == pytest.approx(1.0 + 0.002)
    assert t.landed_s(10**8, 0.5) == t.landed_s(10**8, 0.5, "layers")  # the default
    for offer in ("step", "after"):  # once the step ended: both
        assert t.landed_s(10**8, 0.5, offer) == pytest.approx(0.5 + 0.1 + 0.002)
    with pytest.raises(ValueError, match="unknown KV offer 'soon'"):
        t.landed_s(1, 0.1, "soon")
    assert KV_OFFERS == ("layers", "step", "after")


def test_profile_file_round_trip_and_version_check(tmp_path):
    steps = {1: fit_steps(_points(60)), 2: fit_steps(_points(60, seed=1))}
    p = Profile("m", "float32", {"cpu": "x"}, 16, 36864, 1000, 2048, 256, 2048, steps,
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]))
    path = tmp_path / "p.json"
    save_profile(p, path)
    q = load_profile(path)
    assert q.step(2).seconds([(5, 5)]) == p.step(2).seconds([(5, 5)])
    assert q.step(1).error == p.step(1).error and isinstance(q.step(1).error, FitError)
    with pytest.raises(KeyError, match="--threads"):
        q.step(4)
    path.write_text(path.read_text().replace(f'"version": {PROFILE_VERSION}', '"version": 99'))
    with pytest.raises(ValueError, match="rerun pdserve profile.*--refit"):
        load_profile(path)


def test_the_serving_factor_scales_what_step_hands_out_and_survives_the_file(tmp_path):
    steps = {1: fit_steps(_points(60))}
    p = Profile("m", "float32", {}, 16, 1024, 1000, 2048, 256, 2048, steps,
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]),
                serving={1: 1.25})
    chunks = [(1, 300)] * 8
    assert p.step(1).seconds(chunks) == pytest.approx(1.25 * p.steps[1].seconds(chunks))
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").serving == {1: 1.25}


def test_the_per_sequence_serving_cost_adds_per_sequence_and_survives_the_file(tmp_path):
    steps = {1: fit_steps(_points(60)), 2: fit_steps(_points(60))}
    p = Profile("m", "float32", {}, 16, 1024, 1000, 2048, 256, 2048, steps,
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]),
                serving={1: 1.1, 2: 1.0}, serving_per_seq={1: 0.002, 2: 0.004})
    for batch in (24, 48):  # well above the fastest step measured (the floor)
        chunks = [(1, 300)] * batch
        assert p.step(1).seconds(chunks) == pytest.approx(
            1.1 * p.steps[1].seconds(chunks) + 0.002 * batch)
        assert p.step(2).seconds(chunks) == pytest.approx(
            p.steps[2].seconds(chunks) + 0.004 * batch)
    save_profile(p, tmp_path / "p.json")
    q = load_profile(tmp_path / "p.json")
    assert q.serving_per_seq == {1: 0.002, 2: 0.004}
    assert q.step(1).seconds([(1, 300)] * 8) == pytest.approx(p.step(1).seconds([(1, 300)] * 8))


def test_the_spread_of_served_steps_is_drawn_from_its_quantiles_and_survives_the_file(tmp_path):
    import numpy as np

    from common.cost_model import draw_jitter

    spread = ((0.1, 0.9), (0.5, 1.0), (0.9, 1.3))
    u = np.array([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
    assert draw_jitter(spread, u).tolist() == pytest.approx([0.9, 0.9, 0.95, 1.0, 1.15, 1.3,
                                                             1.3])
    assert draw_jitter((), u).tolist() == [1.0] * len(u)
    steps = {1: fit_steps(_points(60))}
    p = Profile("m", "float32", {}, 16, 1024, 1000, 2048, 256, 2048, steps,
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]),
                serving_jitter={1: spread})
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").serving_jitter == {1: spread}


def test_memory_and_compute_terms_scale_apart(tmp_path):
    from common.cost_model import MEMORY_TERMS

    row = features([(1, 99)])  # the intercept and the decode pairs are the memory terms
    assert [row[i] for i in sorted(MEMORY_TERMS)] == [1.0, 100.0]
    steps = {1: fit_steps(_points(60))}
    p = Profile("m", "float32", {}, 16, 1024, 1000, 2048, 256, 2048, steps,
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]),
                serving={1: 1.8}, serving_compute={1: 1.1})
    for chunks in ([(1, 900)] * 24, [(512, 0)], [(1, 300)] * 8 + [(256, 128)]):
        memory, compute = p.steps[1].parts(chunks)
        assert memory + compute == pytest.approx(p.steps[1].seconds(chunks))
        # the floor (a small decode's) scales as memory
        assert p.step(1).seconds(chunks) == pytest.approx(
            max(1.8 * p.steps[1].floor_s, 1.8 * memory + 1.1 * compute))
    save_profile(p, tmp_path / "p.json")
    q = load_profile(tmp_path / "p.json")
    assert q.serving_compute == {1: 1.1}
    # A profile of one factor scales both alike.
    one = Profile("m", "float32", {}, 16, 1024, 1000, 2048, 256, 2048, steps,
                  p.transfer, serving={1: 1.25})
    assert one.step(1).seconds([(512, 0)]) == pytest.approx(1.25 * p.steps[1].seconds([(512, 0)]))


def test_decode_factors_scale_decode_only_steps_and_survive_the_file(tmp_path):
    steps = {1: fit_steps(_points(60))}
    p = Profile("m", "float32", {}, 16, 1024, 1000, 2048, 256, 2048, steps,
                fit_transfer([(1 << 20, 0.001), (1 << 24, 0.008), (1 << 22, 0.003)]),
                serving={1: 1.25}, serving_per_seq={1: 0.001},
                serving_decode={1: (0.8, 1.5)})
    plain = dataclasses.replace(p, serving_decode={})
    one, three = [(1, 300)], [(1, 300)] * 3
    assert p.step(1).seconds(one) == pytest.approx(0.8 * plain.step(1).seconds(one))
    assert p.step(1).seconds(three) == pytest.approx(1.5 * plain.step(1).seconds(three))
    prefill = [(200, 0), (1, 300)]  # a step that prefills: the table does not apply
    assert p.step(1).seconds(prefill) == plain.step(1).seconds(prefill)
    save_profile(p, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").step(1).seconds(three) == p.step(1).seconds(three)
