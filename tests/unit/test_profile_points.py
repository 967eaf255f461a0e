"""benchmarks.profile: one point per grid shape from its repeated steps."""

from benchmarks.profile import median_points
from benchmarks.profile_steps import QUICK_GRID, StepGrid


def _step(shape, chunks, seconds):
    return {"kind": shape.split()[0], "shape": shape, "chunks": chunks, "seconds": seconds}


def test_a_shapes_point_is_the_median_of_its_rounds():
    steps = []
    for rnd, (a, b) in enumerate([(0.10, 0.50), (0.30, 0.52), (0.11, 0.90), (0.12, 0.51),
                                  (0.09, 2.00)]):
        # the decode shape's context grows by one a step; the point keeps the first's
        steps.append(_step("decode 2@64", [[1, 64 + rnd], [1, 64 + rnd]], a))
        steps.append(_step("prefill 16 cached 0", [[16, 0]], b))
    shapes, points = median_points(steps)
    assert shapes == ["decode 2@64", "prefill 16 cached 0"]
    # two rounds in five caught by a neighbour's burst (0.30, 0.90 / 2.00) move nothing
    assert [p.seconds for p in points] == [0.11, 0.52]
    assert points[0].chunks == ((1, 64), (1, 64)) and points[1].chunks == ((16, 0),)


def test_the_default_grid_runs_five_rounds_and_the_quick_one_three():
    assert StepGrid().reps == 5 and QUICK_GRID.reps == 3
