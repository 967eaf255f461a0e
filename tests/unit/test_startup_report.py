"""benchmarks.startup.report: medians per mode, 'never' for a component that did not
come back, and the fresh / fork-server ratios."""

from benchmarks.startup import Sample, StartupOptions, report


def _sample(mode: str, up: float, back: float | None) -> Sample:
    return Sample(mode, up, {"prefill-0": back, "decode-0": back, "router-1": 1.0})


def test_medians_and_ratios() -> None:
    samples = [_sample("fork server", 4.0, 2.0), _sample("fork server", 6.0, 2.0),
               _sample("fork server", 5.0, 3.0),
               _sample("fresh interpreters", 20.0, 8.0), _sample("fresh interpreters", 10.0, 6.0),
               _sample("fresh interpreters", 15.0, 7.0)]
    table = report(samples, StartupOptions(model="/m/SmolLM2", repeats=3))
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()
            if line.startswith("| ")}
    assert rows["fork server"] == "| fork server | 5.0 s | 2.0 s | 2.0 s | 1.0 s |"
    assert rows["fresh interpreters"] == "| fresh interpreters | 15.0 s | 7.0 s | 7.0 s | 1.0 s |"
    assert rows["fresh / fork server"] == "| fresh / fork server | 3.0x | 3.5x | 3.5x | 1.0x |"
    assert "SmolLM2 fp32, 2 prefill + 2 decode" in table


def test_a_component_never_back_has_no_median() -> None:
    samples = [_sample("fork server", 4.0, None), _sample("fresh interpreters", 9.0, 5.0)]
    table = report(samples, StartupOptions(model="m", repeats=1))
    assert "| fork server | 4.0 s | never | never | 1.0 s |" in table
    assert "| fresh / fork server | 2.2x | - | - | 1.0x |" in table
