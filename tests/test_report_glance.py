"""The report at a glance, on hand-made tables: the sweep's status in the header, the decision columns first,
the smoothed loss curve."""

import math

import numpy as np
import pandas as pd
import pytest

from pipeline.report.columns import DECISION
from pipeline.report.plots import ema
from pipeline.report.render import sweep_status
from pipeline.report.tables import decision_table


def test_ema_is_bias_corrected_and_steps_over_gaps():
    assert ema([2.0, 2.0, 2.0]).tolist() == pytest.approx([2.0, 2.0, 2.0])  # no pull towards 0 at the start
    # weight 0.5: s1 = 0.5 * 0 = 0 / 0.5, s2 = (0.5 * 0 + 0.5 * 10) / (1 - 0.25)
    assert ema([0.0, 10.0], 0.5).tolist() == pytest.approx([0.0, 5 / 0.75])
    smoothed = ema([1.0, np.nan, 3.0], 0.9)
    assert smoothed[1] == smoothed[0] == 1.0 and smoothed[2] == pytest.approx((0.09 * 1 + 0.1 * 3) / 0.19)
    assert math.isnan(ema([np.nan, 1.0])[0])


@pytest.mark.parametrize(
    ("parent", "jobs", "given", "shown"),
    [
        ("FINISHED", ["FINISHED"], None, "FINISHED"),
        ("RUNNING", ["FINISHED", "FAILED"], "FAILED", "FAILED"),  # the sweep's end says what it closes with
        ("RUNNING", ["FINISHED", "FINISHED"], None, "FINISHED (from its jobs: the parent run is still open)"),
        ("RUNNING", ["FINISHED", "KILLED"], None, "FAILED (from its jobs: the parent run is still open)"),
        ("RUNNING", ["FINISHED", "RUNNING"], None, "RUNNING"),
    ],
)
def test_the_header_gives_the_sweeps_final_status(parent, jobs, given, shown):
    table = pd.DataFrame({"sweep_run_id": ["p"] * len(jobs) + ["other"], "status": [*jobs, "RUNNING"]})
    assert sweep_status({"run_id": "p", "status": parent}, table, given) == shown


def test_the_lead_table_is_the_optimizer_what_differs_and_the_decision_columns():
    rows = [("adamw", 8), ("adafactor", 8), ("adamw", 16), ("adafactor", 16)]
    table = pd.DataFrame(
        {
            "model": "tiny",
            "batch_size": [bs for _, bs in rows],
            "backend": "trainer",
            "precision": "fp32",
            "optim": [optim for optim, _ in rows],
            "n [seeds]": 1,
            **{column: [1.0, 2.0, 3.0, 4.0] for column in DECISION},
            "eval loss [nats]": 0.69,
        }
    )
    lead, shared = decision_table(table)
    assert list(lead.columns) == ["optimizer", "batch size [samples]", "n [seeds]", *DECISION]
    assert lead["optimizer"].tolist() == ["adamw", "adafactor", "adamw", "adafactor"]
    assert shared == "every row: model tiny, backend trainer, precision fp32"
