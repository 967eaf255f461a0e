"""How well each serving calibration predicts the steps a worker serves next, replayed on
recorded ``pdserve plan --validate`` runs.

A validation run keeps, per candidate, the serving calibration it was predicted with
(three short waves measured right before it: :mod:`benchmarks.profile_serving`) and its
workers' step traces (:mod:`workers.step_trace`). For each candidate this splits the
traced steps at ``--after`` seconds into the run and compares, on the steps after:

- **waves**: the profile with the calibration the run measured before it started;
- **served**: the profile with the calibration :func:`common.served_fit.fit_served_roles`
  fits on the steps before the split, every role's together and each role's own (what
  the live planner does with the steps its workers publish, ``pdserve up
  --autoscale``).

Each prints the median of ``served / predicted - 1`` over the later decode-only steps
and over the later steps that prefill (TTFT's): the model stands for the median step,
the spread around it is drawn apart; and the error of the decode-only steps' p90, each
counted once per sequence in it, the spread drawn (what ITL p90 is made of). Usage::

    python -m benchmarks.served_replay DIR [DIR ...] [--profile FILE] [--after 60]

where each ``DIR`` holds a ``validation.json`` and its traces (``step-traces.tgz`` or the
``*-steps/`` folders ``--validate`` writes beside it); ``--profile`` defaults to the
``profile.json`` the validation ran with (``DIR/profile.json``, then ``DIR/..``). The
split counts from the run's start as the row saved it (validations that predicted from
served steps); older ones from their first traced step, which is the cluster's warm-up,
seconds earlier, and whose few steps then join the fit.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from common.cost_model import Profile, draw_jitter, load_profile, spread_steps
from common.served_fit import ServedFitError, fit_served_roles
from workers.step_trace import TracedStep, read_step_trace

from .plan_validate import run_name
from .profile_serving import engine_only_of


def trace_dir_name(label: str) -> str:
    """The folder ``--validate`` writes a candidate's traces to."""
    return run_name(label) + "-steps"


def role_and_port(trace: Path) -> tuple[str, str]:
    """The role a worker started with and its port, from its trace file's name
    (``ROLE-PORT.steps.csv``, :func:`cluster.deployment.step_trace_path`)."""
    role, port = trace.name.split(".", 1)[0].split("-", 1)
    return role, port


def traced_steps(folder: Path, role_at: Callable[[str, float], str] | None = None
                 ) -> list[tuple[str, TracedStep]]:
    """Every worker's traced steps in ``folder`` with its role, in time order. A trace
    file keeps the role its worker started with; ``role_at(port, time)``, when given,
    says the role a worker had at a step (one that changed roles in place)."""
    steps: list[tuple[str, TracedStep]] = []
    for f in sorted(folder.glob("*.steps.csv")):
        first, port = role_and_port(f)
        steps += [(role_at(port, s.start_unix_s) if role_at else first, s)
                  for s in read_step_trace(str(f))]
    return sorted(steps, key=lambda rs: rs[1].start_unix_s)


def candidate_steps(root: Path, label: str) -> list[tuple[str, TracedStep]]:
    """A validation candidate's traced steps with their roles, in time order."""
    return traced_steps(root / trace_dir_name(label))


def waves_profile(profile: Profile, threads: int, serving: dict) -> Profile:
    """``profile`` with the calibration a validation row measured (``row["serving"]``;
    the waves fit no decode table)."""
    fitted = bool(serving.get("jitter") and serving.get("jitter_step_ms"))
    return profile.with_serving(
        threads, serving["factor"], serving["compute_factor"], serving["per_seq_ms"] / 1e3,
        jitter=tuple((float(p), float(r)) for p, r in serving["jitter"]) if fitted else None,
        jitter_step_s=serving["jitter_step_ms"] / 1e3 if fitted else 0.0)


def weighted_p90(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    at = np.searchsorted(np.cumsum(weights[order]), 0.9 * weights.sum())
    return float(values[order][min(at, len(values) - 1)])


def errors(profile: Profile, threads: int, steps: list[tuple[str, TracedStep]],
           draws: int = 20) -> tuple[float, float, float]:
    """The median of ``served / predicted - 1`` over the decode-only steps and over the
    steps that prefill (TTFT), each predicted by its role's model
    (:meth:`Profile.for_role`); and the error of the decode-only steps' p90, each step
    counted once per sequence in it (what ITL p90 is made of), predicted as the
    simulator steps: the model with a factor drawn from its role's spread (``draws``
    draws a step, a fixed seed)."""
    roles = {role: profile.for_role(role) for role, _ in steps}
    models = {role: p.step(threads) for role, p in roles.items()}

    def median(group: list[tuple[str, TracedStep]]) -> float:
        if not group:
            return float("nan")
        return float(np.median([s.seconds / models[r].seconds(s.sums) for r, s in group]) - 1)

    decodes = [(r, s) for r, s in steps if s.sums.decode_only]
    p90 = float("nan")
    if decodes:
        rng = np.random.default_rng(0)
        drawn, seqs, served = [], [], []
        for role, p in roles.items():
            mine = [s for r, s in decodes if r == role]
            model = np.repeat([models[role].seconds(s.sums) for s in mine], draws)
            drawn.append(spread_steps(model, draw_jitter(p.serving_jitter.get(threads, ()),
                                                         rng.random(len(model))),
                                      p.serving_jitter_step_s.get(threads)))
            seqs += [s.sums.seqs for s in mine]
            served += [s.seconds for s in mine]
        weights = np.array(seqs, dtype=np.float64)
        p90 = (weighted_p90(np.concatenate(drawn), np.repeat(weights, draws))
               / weighted_p90(np.array(served), weights) - 1)
    return (median(decodes), median([(r, s) for r, s in steps if not s.sums.decode_only]),
            p90)


def threads_of(label: str) -> int:
    """The thread count in a candidate's label (``... x2t ...``)."""
    import re

    found = re.search(r"x(\d+)t", label)
    if found is None:
        raise ValueError(f"no thread count in the candidate label {label!r}")
    return int(found.group(1))


def replay(root: Path, profile: Profile, after_s: float) -> list[dict]:
    validation = json.loads((root / "validation.json").read_text())
    engine_only = engine_only_of(profile)
    rows = []
    for row in validation["rows"]:
        label, t = row["config"], threads_of(row["config"])
        steps = candidate_steps(root, label)
        if not steps or not row.get("serving"):
            continue
        # From the run's start where the row says it (validations since served_window),
        # else from the first traced step: the cluster's warm-up, seconds before the run.
        started = (row.get("served_window") or {}).get("started", steps[0][1].start_unix_s)
        steps = [(r, s) for r, s in steps if s.start_unix_s >= started]
        cut = started + after_s
        before = [(r, s.seconds, s.sums) for r, s in steps if s.start_unix_s < cut]
        later = [(r, s) for r, s in steps if s.start_unix_s >= cut]
        waves = waves_profile(profile, t, row["serving"])
        out = {"run": root.name, "config": label, "steps_before": len(before),
               "steps_after": len(later), "waves": errors(waves, t, later)}
        try:
            fit = fit_served_roles(engine_only.steps[t], t, before)
            out["served"] = errors(fit.apply(profile), t, later)
            out["fit"] = fit.describe()
        except ServedFitError as e:
            out["served"], out["fit"] = None, f"refused: {e}"
        rows.append(out)
    return rows


def _pct(errs: tuple[float, ...] | None) -> str:
    return "refused" if errs is None else " / ".join(f"{e:+.1%}" for e in errs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.served_replay",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--after", type=float, default=60.0,
                        help="seconds into each run the fit's steps end (default 60)")
    args = parser.parse_args(argv)
    rows = []
    for d in args.dirs:
        with tempfile.TemporaryDirectory() as tmp:
            root = d
            if (d / "step-traces.tgz").exists():
                with tarfile.open(d / "step-traces.tgz") as tar:
                    tar.extractall(tmp, filter="data")
                root = Path(tmp)
                (root / "validation.json").write_text((d / "validation.json").read_text())
            path = args.profile or next(str(p) for p in (d / "profile.json",
                                                         d.parent / "profile.json")
                                        if p.exists())
            rows += [{**r, "run": d.name} for r in replay(root, load_profile(path), args.after)]
    print("median error of decode-only steps / of steps that prefill / p90 error of decode "
          "steps, each counted once per sequence (with the spread drawn)")
    w = max([12, *(len(r["run"]) + 2 for r in rows)])
    print(f"{'run':<{w}}{'candidate':<42}{'steps':>12}  {'waves':>24}  {'served fit':>24}")
    for r in rows:
        print(f"{r['run']:<{w}}{r['config']:<42}{r['steps_before']:>5} {r['steps_after']:>6}  "
              f"{_pct(r['waves']):>24}  {_pct(r['served']):>24}")
    for name in ("waves", "served"):
        for i, kind in enumerate(("median error of decode steps", "median error of prefill "
                                  "steps", "p90 error of decode steps")):
            got = [abs(r[name][i]) for r in rows if r[name] is not None and
                   np.isfinite(r[name][i])]
            if got:
                print(f"{name}: mean |{kind}| {np.mean(got):.1%} over {len(got)} candidates")
    for r in rows:
        print(f"{r['run']} {r['config']}: {r['fit']}")


if __name__ == "__main__":
    main()
