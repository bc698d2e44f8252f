"""The tuned comparison: each optimizer at its own best learning rate, chosen on the validation split and
reported on the held-out test split, over seeds, with Welch's test against the baseline.

A sweep that runs an optimizer at more than one learning rate within a point (model, batch size, backend,
precision, ...) gets this section. The rate is chosen by `val_<metric>` (the validation split, carved out of
the training data) and the optimizers are compared by `eval_<metric>` (the held-out test split; the `eval_`
names are kept for compatibility), so the split that scores a rate never picks it. One learning rate per
optimizer compares optimizers at rates that may suit one and not another: the report says so instead.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import numpy as np
import pandas as pd

from pipeline.report.columns import (
    BASELINE,
    GROUP,
    KEY_LABELS,
    LOWER_IS_BETTER,
    METHOD,
    METRIC_LABELS,
    METRIC_UNITS,
    QUALITY,
    RATES,
    SEEDS,
    TARGET_FRACTION,
    TUNED_TESTS,
    UNTUNED_NOTE,
    UNTUNED_NOTE_LM,
)
from pipeline.report.tables import (
    _optimizer_order,
    comparison_group,
    format_table,
    is_baseline,
    method_order,
    point_columns,
    row_keys,
    with_method,
    with_task,
)

# a mean over seeds that equals the target up to rounding reaches it
TOLERANCE = 1e-12
NOT_LEARNED = "no rate learned at this budget"  # the best lr of an optimizer whose every rate collapsed


class Tuned(NamedTuple):
    """The section's frames: `table` one row per (point, optimizer) at its best rate; `rates` the validation
    metric per rate tried (plot against the rate); `curves` the validation series, mean over seeds, at each
    best rate (plot over steps); `metric` the metric that picked the rates (a METRIC_LABELS key);
    `target_fraction` the steps-to-target share."""

    table: pd.DataFrame
    rates: pd.DataFrame
    curves: pd.DataFrame
    metric: str
    target_fraction: float


def _finished(jobs: pd.DataFrame) -> pd.DataFrame:
    """Finished jobs with every column the section reads (empty where not logged); collapsed as a bool."""
    columns = list(dict.fromkeys([*jobs.columns, *GROUP, "optim", *RATES, "collapsed"]))
    done = with_method(with_task(jobs[jobs.status == "FINISHED"].reindex(columns=columns)))
    # an empty column as float NaN, as grouping gives it back, so that the frames merge on it
    empty = [c for c in done if done[c].isna().all() and not pd.api.types.is_datetime64_any_dtype(done[c])]
    done[empty] = done[empty].astype(float)
    return done.assign(collapsed=done.collapsed.astype("boolean").fillna(False).astype(bool))


def _values(frame: pd.DataFrame, column: str) -> pd.Series:
    """`column` as floats, all NaN where it was not logged."""
    return frame.reindex(columns=[column])[column].astype(float)


def tuned_points(jobs: pd.DataFrame) -> list[str]:
    """What a tuned row is besides the optimizer: the comparison's point without the learning rate, which
    is what gets chosen (with the method, where some run is not full fine-tuning)."""
    return [c for c in point_columns(jobs) if c not in RATES]


def is_tuned(jobs: pd.DataFrame) -> bool:
    """Whether some optimizer finished at more than one learning rate within a point."""
    done = _finished(jobs)
    return bool(done.groupby(tuned_points(done) + ["optim"], dropna=False).lr.nunique().gt(1).any())


def rate_note(jobs: pd.DataFrame, metric: str = QUALITY) -> str | None:
    """The preamble's line on how fair the quality comparison is; None without finished jobs. `metric`: the
    one that picks a rate (a language model's: `loss`, the lowest)."""
    if not (jobs.status == "FINISHED").any():
        return None
    lower = metric in LOWER_IS_BETTER
    if not is_tuned(jobs):
        return UNTUNED_NOTE_LM if lower else UNTUNED_NOTE
    if _values(jobs, f"val_{metric}").isna().all():
        return (
            f"several learning rates per optimizer, but no validation metric (`val_{metric}`) was logged: "
            "no rate is chosen (the test split must not pick it); see docs/tuning.md for the tuned protocol"
        )
    return (
        f"learning rates tuned: each optimizer at the rate with the {'lowest' if lower else 'best'} mean "
        f"`val_{metric}` over seeds "
        "(validation split, carved out of the training data), compared on the held-out test split "
        "(`eval_*`); see the section Tuned learning rate"
    )


def off_reference(jobs: pd.DataFrame) -> str | None:
    """The line naming the optimizers whose finished training jobs ran at a rate other than a tuned reference
    (param `lr_tuned`: the rate a tuning sweep picked for it, conf/optim `lr_tuned: true`): `custom at 5e-05
    (its reference, untuned)`, `adamw at 0.0005 (its reference 0.000158)`. None where every one ran at its tuned
    rate, where rates were tuned in this sweep (the tuned section says), or for runs that do not say."""
    done = jobs[jobs.status == "FINISHED"]
    if "lr_tuned" not in done or done.empty or is_tuned(done):
        return None
    said = done[done.lr_tuned.notna()]
    off = said[said.lr_tuned.astype(str).ne("True")]
    if off.empty:
        return None
    names = []
    for (optim, lr), runs in off.groupby(["optim", "lr"], sort=False):
        reference = runs.reindex(columns=["lr_reference"]).lr_reference.iloc[0]
        if pd.isna(reference):
            why = "reference unknown"
        elif float(reference) == float(lr):
            why = "its reference, untuned"
        else:
            why = f"its reference {float(reference):g}"
        names.append(f"{optim} at {float(lr):g} ({why})")
    return (
        "off a tuned learning rate: " + ", ".join(names) + "; their quality figures compare rates as much as "
        "optimizers (docs/tuning.md)"
    )


def rate_table(jobs: pd.DataFrame, metric: str = QUALITY) -> pd.DataFrame:
    """One row per (point, optimizer, learning rate): its lr scale, finished runs, the validation metric's
    n, mean and sample std over seeds, and how many of the runs collapsed to one class."""
    done = _finished(jobs)
    keys = row_keys(tuned_points(done)) + ["lr"]
    grouped = done.assign(value=_values(done, f"val_{metric}")).groupby(keys, dropna=False)
    rates = pd.concat(
        [
            grouped.lr_scale.first(),
            grouped.size().rename("runs"),
            grouped.value.agg(["count", "mean", "std"]).rename(columns={"count": "n"}),
            grouped.collapsed.sum(),
        ],
        axis=1,
    ).reset_index()
    return _sorted(rates, keys)


def _sorted(frame: pd.DataFrame, keys: list[str], baseline: str = BASELINE) -> pd.DataFrame:
    """Sorted by point, baseline first among the optimizers (then by name), each optimizer's methods full
    first, then by the rest of `keys`."""
    order = pd.Categorical(frame.optim, _optimizer_order(frame.optim, baseline))
    frame = frame.assign(optim=order)
    if METHOD in keys:
        frame[METHOD] = pd.Categorical(frame[METHOD], method_order(frame[METHOD]))
    frame = frame.sort_values(keys, ignore_index=True).assign(optim=lambda f: f.optim.astype(str))
    return frame.assign(**{METHOD: frame[METHOD].astype(str)}) if METHOD in keys else frame


def select_best(rates: pd.DataFrame, keys: list[str], lower: bool = False) -> pd.DataFrame:
    """Per (point, optimizer) in `keys`: the rate with the highest mean validation value over seeds (`lower`:
    the lowest, a loss), among the rates without a collapsed run (a run that predicts one class can still
    score a fair mean on a skewed split); ties go to the smaller rate. Beside it: the rates tried (text),
    `edge`: "lowest" / "highest" when
    the best is at that end of two or more rates (the optimum may lie outside the grid), `collapsed_runs`
    over all rates and `learned`: whether some rate had no collapsed run. A (point, optimizer) with no such
    rate, or no validation value, has no best."""
    rates = rates.sort_values([*keys, "lr"], ignore_index=True)
    scored = rates[rates["mean"].notna()].assign(clean=lambda f: f.collapsed.eq(0))
    candidates = scored[scored.clean]
    means = candidates.groupby(keys, dropna=False)["mean"]
    best = candidates.loc[means.idxmin() if lower else means.idxmax()]
    grid = rates.groupby(keys, dropna=False).agg(
        tried=("lr", lambda lr: ", ".join(f"{r:g}" for r in sorted(lr.dropna().unique()))),
        low=("lr", "min"),
        high=("lr", "max"),
        count=("lr", "nunique"),
        collapsed_runs=("collapsed", "sum"),
        learned=("collapsed", lambda c: bool(c.eq(0).any())),
    )
    chosen = grid.reset_index().merge(best.drop(columns=["clean", "collapsed"]), on=keys, how="left")
    several = chosen["count"] >= 2
    edge = np.where(several & chosen.lr.eq(chosen.low), "lowest", "")
    edge = np.where(several & chosen.lr.eq(chosen.high), "highest", edge)
    return chosen.assign(edge=edge).drop(columns=["low", "high", "count"])


def welch(a, b) -> float:
    """p-value of Welch's two-sided t-test (unequal variances) of two samples (scipy.stats.ttest_ind with
    equal_var=False); NaN when either sample has fewer than 2 values, and when neither has any spread (the
    test is undefined there: scipy answers NaN or, through rounding, a p of 0)."""
    a, b = pd.Series(a, dtype=float).dropna(), pd.Series(b, dtype=float).dropna()
    if min(len(a), len(b)) < 2 or (a.nunique() == 1 and b.nunique() == 1):
        return math.nan
    from scipy import stats

    with warnings.catch_warnings():  # identical samples: NaN, with a warning we need not print
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def against_baseline(runs: pd.DataFrame, points: list[str], column: str, baseline: str) -> pd.DataFrame:
    """Per (point, optimizer, method) of `runs` (each at its best rate): Δ = mean of `column` minus the
    baseline's mean at the same point (the baseline optimizer's full fine-tuning, unless `baseline` names a
    method: `adamw lora r=16`), Welch's p over seeds, and n on each side ("3 vs 3"). Empty against itself or
    where the point has no baseline."""
    group = comparison_group(points)
    own = row_keys(points)[len(group) :]  # the optimizer, and the method where it is a key
    rows = []
    for _, at_point in runs.groupby(group, dropna=False):
        base_rows = is_baseline(at_point, baseline)
        base = _values(at_point[base_rows], column).dropna()
        for _, side in at_point.groupby(own):
            values = _values(side, column).dropna()
            compared = not base_rows[side.index].all() and len(base) > 0
            rows.append(
                {
                    **side.iloc[0][[*group, *own]].to_dict(),
                    "delta": values.mean() - base.mean() if len(base) else math.nan,
                    "p": welch(values, base) if compared else math.nan,
                    "n_vs": f"{len(values)} vs {len(base)}" if compared else "",
                }
            )
    return pd.DataFrame(rows, columns=[*group, *own, "delta", "p", "n_vs"])


def mean_curves(history: pd.DataFrame, runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The validation series of `runs` (history: run_id, step, value), averaged over seeds by step: one row
    per (`keys`, step) with mean, std and n. A run validated once, at its end, has no series (eval.every_steps
    was 0): its one value would read as a target reached at that step."""
    history = history[history.groupby("run_id").step.transform("nunique") > 1]
    curves = history.merge(runs[["run_id", *keys]], on="run_id")
    curves = curves.groupby([*keys, "step"], dropna=False).value.agg(["mean", "std", "count"])
    return curves.rename(columns={"count": "n"}).reset_index()


def steps_to_target(curves: pd.DataFrame, keys: list[str], lower: bool = False) -> pd.DataFrame:
    """Per (`keys`) with a series: the first step whose mean over seeds reaches the row's `target` (`lower`:
    falls to it) (NaN when none does) and `reached`."""
    if lower:
        hit = curves.step.where(curves["mean"] <= curves.target + TOLERANCE)
    else:
        hit = curves.step.where(curves["mean"] >= curves.target - TOLERANCE)
    first = curves.assign(hit=hit).groupby(keys, dropna=False).hit.min().rename("steps").reset_index()
    return first.assign(reached=first.steps.notna())


def _mean_std(runs: pd.DataFrame, keys: list[str], columns: dict[str, str]) -> pd.DataFrame:
    """Mean and sample std over seeds of each metric in `columns` (label <- metric), per `keys`."""
    values = pd.concat(
        [runs[keys], *(_values(runs, m).rename(label) for label, m in columns.items())], axis=1
    )
    grouped = values.groupby(keys, dropna=False)
    return pd.concat([grouped.mean(), grouped.std(ddof=1).add_suffix(" std")], axis=1).reset_index()


def tuned_section(
    jobs: pd.DataFrame,
    history: pd.DataFrame | None = None,
    metric: str = QUALITY,
    baseline: str = BASELINE,
    target_fraction: float = TARGET_FRACTION,
) -> Tuned | None:
    """The tuned section of training `jobs` (history: the `val_<metric>` series, run_id, step, value), or
    None where no optimizer ran at several rates in a point, or no validation metric was logged. `metric`: a
    classifier's QUALITY_METRICS key (the highest wins), or `loss` for a language model's jobs (the lowest
    wins, compared on the test split's loss and perplexity)."""
    if not is_tuned(jobs) or _values(jobs, f"val_{metric}").isna().all():
        return None
    lower = metric in LOWER_IS_BETTER
    name, unit, val, test = METRIC_LABELS[metric], METRIC_UNITS[metric], f"val_{metric}", f"eval_{metric}"
    done = _finished(jobs)
    points = tuned_points(done)
    keys = row_keys(points)
    rates = rate_table(done, metric)
    best = select_best(rates, keys, lower)
    # the target: a share of the best final validation value among the point's optimizers (and methods), each
    # at its best rate (a loss: that best divided by the share, the value to fall to)
    final = best.groupby(comparison_group(points), dropna=False)["mean"]
    best["target"] = (
        final.transform("min") / target_fraction if lower else target_fraction * final.transform("max")
    )
    runs = done.merge(best[[*keys, "lr"]].dropna(subset=["lr"]), on=[*keys, "lr"])
    history = pd.DataFrame(columns=["run_id", "step", "value"]) if history is None else history
    curves = mean_curves(history, runs, keys).merge(best[[*keys, "target"]], on=keys)
    tests = TUNED_TESTS.get(metric) or {
        f"test {METRIC_LABELS[m]} [0-1]": f"eval_{m}" for m in dict.fromkeys(["macro_f1", "f1", metric])
    }
    figures = {
        f"val {name} {unit}": val,
        **tests,
        "state [MB]": "optimizer_state_mb",
        "peak [MB]": "peak_memory_mb",
    }
    table = (
        best[[*keys, "tried", "lr", "lr_scale", "edge", "collapsed_runs", "learned", "target"]]
        .merge(runs.groupby(keys, dropna=False).size().rename(SEEDS).reset_index(), on=keys, how="left")
        .merge(_mean_std(runs, keys, figures), on=keys, how="left")
        .merge(against_baseline(runs, points, test, baseline), on=keys, how="left")
        .merge(steps_to_target(curves, keys, lower), on=keys, how="left")
    )
    table = table.rename(
        columns={
            "tried": "rates tried",
            "lr": "best lr",
            "lr_scale": "best lr scale",
            "collapsed_runs": "collapsed [runs]",
            "delta": f"Δ test {name} {unit}",
            "p": "p (Welch)",
            "n_vs": "n vs baseline [seeds]",
            "target": f"target {unit}",
            "steps": "steps to target [steps]",
            "reached": "target reached",
        }
    )
    table[SEEDS] = table[SEEDS].fillna(0).astype(int)
    if table["best lr scale"].isna().all():
        table = table.drop(columns="best lr scale")
    if lower:  # a language model's runs: no prediction of a class, nothing collapses
        table = table.drop(columns="collapsed [runs]")
    order = [*keys, SEEDS, "rates tried", "best lr", "best lr scale", "edge", "collapsed [runs]", "learned"]
    order += [f"val {name} {unit}", *tests, f"Δ test {name} {unit}", "p (Welch)", "n vs baseline [seeds]"]
    order += ["state [MB]", "peak [MB]", f"target {unit}", "steps to target [steps]", "target reached"]
    table = table[[c for column in order for c in (column, f"{column} std") if c in table]]
    rates = rates.merge(best[[*keys, "lr"]].assign(best=True), on=[*keys, "lr"], how="left")
    rates["best"] = rates.best.astype("boolean").fillna(False).astype(bool)
    table, rates = _sorted(table, keys, baseline), _sorted(rates, [*keys, "lr"], baseline)
    return Tuned(table, rates, _sorted(curves, [*keys, "step"], baseline), metric, target_fraction)


def format_tuned(table: pd.DataFrame, columns: list[str] | None = None) -> pd.DataFrame:
    """The tuned table for people: numbers as the comparison's (± std where there is one), the text
    columns as they are, "not reached" where a series never reached the target."""
    text = ["rates tried", "edge", "n vs baseline [seeds]", "target reached", "learned"]
    numbers = [c for c in table.columns[table.columns.get_loc(SEEDS) + 1 :] if not c.endswith(" std")]
    shown = format_table(table, [c for c in numbers if c not in text])
    # the figures are the best rate's, never a collapsed run's: the optimizer needs no mark here
    shown[KEY_LABELS["optim"]] = table.optim.to_numpy()
    for column in text[:3]:
        shown[column] = table[column].fillna("")
    if "learned" in table:  # every rate had a collapsed run: no best to name
        shown["best lr"] = shown["best lr"].where(table.learned.ne(False), NOT_LEARNED)
    steps = "steps to target [steps]"
    shown[steps] = shown[steps].where(table["target reached"].ne(False).fillna(True), "not reached")
    keys = [KEY_LABELS.get(c, c) for c in table.columns[: table.columns.get_loc(SEEDS)]]
    hidden = ("target reached", "learned", SEEDS)
    return shown[[*keys, SEEDS, *[c for c in columns or numbers if c not in hidden]]]


def tuned_console(table: pd.DataFrame) -> str:
    """The short tuned table printed with the comparison: the first test figure, its Δ against the baseline
    where there is one (tuned.csv read back leaves an empty Δ out), the steps to the target."""
    test = next(c for c in table if c.startswith("test ") and not c.endswith(" std"))
    columns = ["best lr", "edge", test, f"Δ {test}", "p (Welch)", "n vs baseline [seeds]"]
    columns = [c for c in [*columns, "steps to target [steps]"] if c in table]
    return format_tuned(table, columns).to_string(index=False)
