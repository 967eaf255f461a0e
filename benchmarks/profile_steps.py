"""The engine half of ``pdserve profile``: time real engine steps of chosen shapes.

Runs in a child process per thread count (:mod:`benchmarks.profile` starts it with
``OMP_NUM_THREADS`` set, and the engine sets torch's threads before any work), so each
thread count has its own OpenMP team. The child builds one :class:`LLMEngine`, wraps its
scheduler's ``schedule`` (on this instance only) to see each step's chunks, and times
``engine.step()`` around them: the step a worker runs, scheduling, forward, sampling and
detokenizing included. Per repetition, in this order:

1. **prefill**: a lone prompt of ``new`` fresh tokens after a ``cached`` prefix. The
   prefixes are sent first (one request each, untimed) so the prefix cache holds them;
   every prompt's own tokens are fresh random ids, so the cache serves the prefix and
   nothing else (each step's chunks are checked against the intended ``(new, cached)``);
2. **mixed**: a decode batch plus one fresh prefill chunk, the step a colocated worker
   runs: the batch enters through the decode worker's door (random KV, see
   :func:`benchmarks.step_profile.start_decoding`), decodes one untimed step, then a
   prompt is added and the next step (its decodes and the whole prompt) is timed;
3. **decode**: ``batch`` sequences of ``context`` tokens, the same way in; one untimed
   step, then ``decode_steps`` timed ones (the context grows by one a step).

A few prefills at the start warm the engine up and are discarded. Prompts are random
ids of the tokenizer's ordinary vocabulary, greedy, EOS ignored. Shapes past the
engine's limits are capped (``new`` to the token budget and the context, ``context`` to
the context). The result is every timed step, with its shape's label, as JSON in a file
(no pickle): ``python -m benchmarks.profile_steps --out FILE ...``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.step_profile import start_decoding
from loadtest.vocab import from_tokenizer
from workers.engine.llm_engine import LLMEngine
from workers.engine.model_runner import model_context_len
from workers.engine.params import EngineConfig, SamplingParams, default_block_size

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class StepGrid:
    """What to measure. ``mixed``: (decode batch, its context, prefill tokens)."""

    prefill_new: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048)
    prefill_cached: tuple[int, ...] = (0, 256, 1024)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    decode_contexts: tuple[int, ...] = (64, 256, 1024)
    mixed: tuple[tuple[int, int, int], ...] = (
        (4, 256, 64), (4, 256, 512), (16, 256, 256), (16, 1024, 128), (32, 256, 1024),
        (64, 256, 64), (8, 1024, 512), (32, 64, 1536))
    reps: int = 5
    """Rounds over the grid; a shape's point is the median of its steps in all rounds
    (:func:`benchmarks.profile.median_points`)."""
    decode_steps: int = 2
    """Timed decode steps per repetition (after one untimed)."""

    def __post_init__(self) -> None:
        sizes = (*self.prefill_new, *self.decode_batches, *self.decode_contexts,
                 *(x for m in self.mixed for x in m))
        if self.reps < 1 or self.decode_steps < 1 or any(x < 1 for x in sizes) \
                or any(c < 0 for c in self.prefill_cached) or not self.prefill_new:
            raise ValueError(f"a step grid needs reps, decode_steps and every size >= 1 "
                             f"(cached prefixes >= 0) and some prefills: {self}")

    @classmethod
    def from_json(cls, d: dict) -> StepGrid:
        return cls(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                      if isinstance(v, list) else v for k, v in d.items()})

    def capped(self, budget: int, max_num_seqs: int, max_model_len: int, block_size: int
               ) -> StepGrid:
        """This grid within an engine's limits: ``new`` at most the token budget and the
        context, prefixes whole blocks that leave room, batches at most ``max_num_seqs``,
        contexts and mixed shapes that fit (duplicates dropped)."""
        room = self.room(max_model_len)
        cached = sorted({c // block_size * block_size for c in self.prefill_cached
                         if c + 1 < room})
        news = sorted({min(n, budget, room) for n in self.prefill_new})
        batches = sorted({min(b, max_num_seqs) for b in self.decode_batches})
        contexts = sorted({min(c, room) for c in self.decode_contexts})
        mixed = tuple(dict.fromkeys((min(b, max_num_seqs - 1), min(c, room),
                                     min(n, budget - b, room))
                                    for b, c, n in self.mixed
                                    if budget - b >= 1 and max_num_seqs >= 2))
        return StepGrid(tuple(news), tuple(cached), tuple(batches), tuple(contexts), mixed,
                        self.reps, self.decode_steps)

    def room(self, max_model_len: int) -> int:
        """The longest prompt a shape may have: it must stay below ``max_model_len`` as it
        decodes."""
        return max_model_len - self.decode_steps - 4

    def prefill_shapes(self, max_model_len: int) -> list[tuple[int, int]]:
        """(new, cached) of every prefill: ``new`` cut to what the context leaves."""
        room = self.room(max_model_len)
        return list(dict.fromkeys((min(n, room - c), c) for c in self.prefill_cached
                                  for n in self.prefill_new if room - c >= 1))

    def kv_tokens(self, max_model_len: int, block_size: int) -> int:
        """KV slots the grid holds at once, at most (the child sizes its pool to it)."""
        grow = self.decode_steps + 4 + block_size  # decoding, and a part-filled block
        decode = max((b * (c + grow) for b in self.decode_batches
                      for c in self.decode_contexts), default=0)
        mixed = max((b * (c + grow) + n + block_size for b, c, n in self.mixed), default=0)
        prefill = (sum(c + block_size for c in self.prefill_cached)
                   + max(n + c for n, c in self.prefill_shapes(max_model_len)) + block_size)
        return max(decode, mixed) + prefill


QUICK_GRID = StepGrid(prefill_new=(16, 64, 256, 1024, 2048), prefill_cached=(0, 1024),
                      decode_batches=(1, 4, 16, 64), decode_contexts=(64, 1024),
                      mixed=((8, 256, 256), (32, 256, 1024)), reps=3)


@dataclass(frozen=True)
class TimedStep:
    kind: str  # prefill | mixed | decode
    shape: str
    """The grid shape it measures (steps of one shape are repetitions)."""
    chunks: tuple[tuple[int, int], ...]  # (new tokens, start) per sequence
    seconds: float


class StepClock:
    """Times ``engine.step()`` and reports the chunks it ran. Installs a wrapper on the
    engine's scheduler instance (nothing in ``workers/`` changes); :meth:`close` removes
    it. Engine thread only."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._scheduler = engine.scheduler
        original = self._scheduler.schedule
        self._last = None

        def schedule():  # noqa: ANN202 - SchedulerOutput
            self._last = original()
            return self._last

        self._scheduler.schedule = schedule  # type: ignore[method-assign]

    def step(self) -> tuple[tuple[tuple[int, int], ...], float, list]:
        """(chunks, wall seconds, outputs) of one engine step."""
        self._last = None
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - start
        out = self._last
        chunks = tuple((c.num_tokens, c.start) for c in out.chunks) if out else ()
        return chunks, elapsed, outputs

    def close(self) -> None:
        vars(self._scheduler).pop("schedule", None)


class Prompts:
    """Fresh random prompts of ordinary token ids: no two share a block."""

    def __init__(self, engine: LLMEngine, seed: int) -> None:
        vocab = engine.runner.vocab_size
        self.pool = [i for i in from_tokenizer(engine.config.model) if i < vocab]
        if len(self.pool) < 16:
            raise ValueError(f"the tokenizer of {engine.config.model} has only "
                             f"{len(self.pool)} ordinary ids below the vocabulary size {vocab}")
        self.rng = random.Random(seed)
        self._ids = itertools.count()

    def rid(self, kind: str) -> str:
        """A request id no other request of the run has."""
        return f"profile-{kind}-{next(self._ids)}"

    def __call__(self, n: int) -> list[int]:
        return self.rng.choices(self.pool, k=n)


def measure(engine: LLMEngine, grid: StepGrid, seed: int = 0,
            progress: Callable[[str], None] | None = None) -> list[TimedStep]:
    """Every timed step of ``grid`` (see the module docstring) on an idle engine; leaves
    it idle with an empty prefix cache. Raises RuntimeError when a step's chunks are not
    the shape it was set up for."""
    if engine.has_unfinished_requests():
        raise RuntimeError("profile an idle engine: it still has requests")
    cfg = engine.config
    grid = grid.capped(cfg.max_num_batched_tokens, cfg.max_num_seqs, engine.max_model_len,
                       cfg.block_size)
    prompts = Prompts(engine, seed)
    order = random.Random(seed + 1)
    steps: list[TimedStep] = []
    clock = StepClock(engine)
    try:
        with _no_gc():
            for n in sorted(set(grid.prefill_new))[:4] + [max(grid.prefill_new)]:
                _run_alone(clock, prompts.rid("warmup"), prompts(n))  # discarded
            for rep in range(grid.reps):
                for kind, phase in (("prefill", _prefills), ("mixed", _mixed),
                                    ("decode", _decodes)):
                    start, before = time.perf_counter(), len(steps)
                    phase(clock, grid, prompts, order, steps)
                    if progress:
                        progress(f"rep {rep + 1}/{grid.reps}: {kind}, "
                                 f"{len(steps) - before} steps in "
                                 f"{time.perf_counter() - start:.1f} s")
    finally:
        clock.close()
        engine.abort_all()
        engine.scheduler.block_manager.reset_prefix_cache()
    return steps


@contextmanager
def _no_gc() -> Iterator[None]:
    """No collector pause inside a timed step: collect between shapes instead."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _run_alone(clock: StepClock, rid: str, prompt: list[int]
               ) -> tuple[tuple[tuple[int, int], ...], float]:
    """Add one single-token request and step until it finishes; the last step's
    (chunks, seconds)."""
    clock.engine.add_request(rid, prompt, ONE_TOKEN)
    while True:
        chunks, seconds, outputs = clock.step()
        if any(o.finished for o in outputs):
            return chunks, seconds
        if not clock.engine.has_unfinished_requests():
            raise RuntimeError(f"request {rid} vanished without finishing")


def _prefills(clock: StepClock, grid: StepGrid, prompts: Prompts, order: random.Random,
              steps: list[TimedStep]) -> None:
    prefixes = {c: prompts(c) for c in grid.prefill_cached if c}
    for prefix in prefixes.values():  # into the prefix cache, untimed
        _run_alone(clock, prompts.rid("prefix"), prefix)
    shapes = grid.prefill_shapes(clock.engine.max_model_len)
    order.shuffle(shapes)
    for n, c in shapes:
        chunks, seconds = _run_alone(clock, prompts.rid("prefill"),
                                     prefixes.get(c, []) + prompts(n))
        if chunks != ((n, c),):
            raise RuntimeError(f"a prefill of {n} tokens after {c} cached ran as {chunks}: "
                               "the prefix cache did not serve what was set up")
        steps.append(TimedStep("prefill", f"prefill {n} cached {c}", chunks, seconds))
        gc.collect()


def _decoding(clock: StepClock, prompts: Prompts, batch: int, context: int,
              steps: int) -> list[str]:
    """``batch`` sequences of ``context`` tokens decoding, one untimed step done."""
    ids = start_decoding(clock.engine, [prompts(context) for _ in range(batch)],
                         max_tokens=steps + 4)
    chunks, _, _ = clock.step()
    if chunks != ((1, context),) * batch:
        raise RuntimeError(f"a decode batch of {batch} at {context} ran as {chunks[:4]}...")
    return ids


def _end(clock: StepClock, ids: list[str]) -> None:
    for rid in ids:
        clock.engine.abort_request(rid)
    gc.collect()


def _mixed(clock: StepClock, grid: StepGrid, prompts: Prompts, order: random.Random,
           steps: list[TimedStep]) -> None:
    shapes = list(grid.mixed)
    order.shuffle(shapes)
    for b, ctx, n in shapes:
        ids = _decoding(clock, prompts, b, ctx, 2)
        try:
            clock.engine.add_request(prompts.rid("mixed"), prompts(n), ONE_TOKEN)
            chunks, seconds, _ = clock.step()
            if chunks != ((1, ctx + 1),) * b + ((n, 0),):
                raise RuntimeError(f"a mixed step ({b} decodes at {ctx} + a {n}-token "
                                   f"prefill) ran as {chunks[:2]}...{chunks[-1:]}")
            steps.append(TimedStep("mixed", f"mixed {b}@{ctx} + {n}", chunks, seconds))
        finally:
            _end(clock, ids)


def _decodes(clock: StepClock, grid: StepGrid, prompts: Prompts, order: random.Random,
             steps: list[TimedStep]) -> None:
    shapes = [(b, c) for b in grid.decode_batches for c in grid.decode_contexts]
    order.shuffle(shapes)
    for b, ctx in shapes:
        ids = _decoding(clock, prompts, b, ctx, grid.decode_steps)
        try:
            for _ in range(grid.decode_steps):
                chunks, seconds, _ = clock.step()
                steps.append(TimedStep("decode", f"decode {b}@{ctx}", chunks, seconds))
        finally:
            _end(clock, ids)


# -- the child process -----------------------------------------------------------------

def engine_for(model: str, dtype: str, threads: int, grid: StepGrid, block_size: int,
               max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int | None,
               kernel_cache_dir: str | None) -> LLMEngine:
    """An engine with a pool big enough for the whole grid at this model's context."""
    context = min(max_model_len or model_context_len(Path(model)), model_context_len(Path(model)))
    need = grid.capped(max_num_batched_tokens, max_num_seqs, context, block_size
                       ).kv_tokens(context, block_size)
    return LLMEngine(EngineConfig(
        model=model, dtype=dtype, block_size=block_size, num_blocks=-(-need // block_size) + 64,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, num_threads=threads, kernel_cache_dir=kernel_cache_dir))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--grid", required=True, help="a StepGrid as JSON")
    p.add_argument("--block-size", type=int, default=default_block_size("cpu"))
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kernel-cache-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where the JSON result goes")
    args = p.parse_args(argv)
    grid = StepGrid.from_json(json.loads(args.grid))
    started = time.perf_counter()
    engine = engine_for(args.model, args.dtype, args.threads, grid, args.block_size,
                        args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len,
                        args.kernel_cache_dir)

    def progress(line: str) -> None:
        print(f"  [{args.threads} thread(s)] {line}", file=sys.stderr, flush=True)

    progress(f"engine ready ({engine.dtype}) in {time.perf_counter() - started:.1f} s")
    steps = measure(engine, grid, args.seed, progress)
    Path(args.out).write_text(json.dumps({
        "dtype": engine.dtype, "block_bytes": engine.runner.block_bytes,
        "gemv_rows": engine.runner.gemv_handover_rows,
        "context_len": model_context_len(Path(args.model)),
        "steps": [asdict(s) for s in steps]}))


if __name__ == "__main__":
    main()
