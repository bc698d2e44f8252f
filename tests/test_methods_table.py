"""`make methods-table` (bench/methods_table.py): its two commands sweep exactly the seven ways to train, and the
page says what was measured and what planned, with a row for each way (a way without a run says so)."""

import itertools

import pandas as pd
from hydra.core.override_parser.overrides_parser import OverridesParser

from bench import methods_table


def points(overrides: list[str]) -> set[tuple[str, str]]:
    """(peft, optim) of every point a `-m` command sweeps (peft: none where the command leaves it alone)."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = {
        o.key_or_group: list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        for o in parsed
    }
    return set(itertools.product(values.get("peft", ["none"]), values["optim"]))


def test_the_two_commands_sweep_the_seven_ways_and_nothing_else():
    commands = methods_table.commands(["model=tiny"])
    assert len(commands) == 2
    found = [points(c) for c in commands]
    assert not found[0] & found[1]
    assert found[0] | found[1] == set(methods_table.WAYS)
    assert len(methods_table.WAYS) == len(methods_table.NAMES) == 7


def test_the_page_holds_each_way_says_measured_and_planned_and_what_the_quality_figures_are_not(tmp_path):
    start = pd.Timestamp("2026-12-04 13:07", tz="UTC")
    jobs = pd.DataFrame(
        [
            {
                "optim": "adamw",
                "method": "full",
                "status": "FINISHED",
                "start_time": start,
                "end_time": start + pd.Timedelta(minutes=5),
                "model_num_params": 65783042.0,
                "optimizer_state_mb": 501.885,
                "peak_memory_mb": 1173.7,
                "collapsed": True,
            },
            {
                "optim": "adamw",
                "method": "qlora r=16 nf4",
                "status": "FINISHED",
                "start_time": start + pd.Timedelta(minutes=6),
                "end_time": start + pd.Timedelta(minutes=9),
                "model_num_params": 66965000.0,
                "model_trainable_params": 1181954.0,
                "collapsed": False,
            },
        ]
    )
    measured = methods_table.measured_rows(jobs)
    assert [r["way"] for r in measured] == [methods_table.NAMES[w] for w in methods_table.WAYS]
    by_way = {r["way"]: r for r in measured}
    assert by_way["QLoRA + AdamW"]["trainable params"] == 1181954  # the adapters', not the model's
    assert by_way["AdamW"]["trainable params"] == 65783042  # full fine-tuning: every parameter
    assert by_way["LoRA + AdamW"]["status"] == "not run"
    planned = methods_table.planned_rows(jobs.assign(fits=[0.0, 1.0]))
    assert [r["fits"] for r in planned if r["fits"]] == ["no", "yes"]
    text = methods_table.page(
        measured, planned, ["verdict: fits rtx-4090 ..."], [["a"]], [["b"]], [60.0, 2.0], 20
    )
    assert "**Measured** (on this CPU" in text and "**Planned** (no training, no GPU" in text
    assert "says nothing about the methods' quality" in text
    assert "from 2026-12-04 13:07 to 2026-12-04 13:16 UTC" in text
    assert "      verdict: fits rtx-4090 ..." in text
    tables = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(tables) == 2 * (2 + 7)
    assert "| QLoRA + AdamW | qlora r=16 nf4 | adamw | FINISHED | 1,181,954 |" in text
