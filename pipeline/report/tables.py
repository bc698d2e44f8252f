"""The job table shaped into the report's tables: the comparison and its Pareto front, failed jobs, largest
batches, and their text for people."""

from __future__ import annotations

import pandas as pd

from pipeline import HARDLY_LEARNED
from pipeline.report.columns import (
    BASELINE,
    CAUSAL_LM,
    CLASSIFICATION,
    COLLAPSED,
    COLUMNS,
    CONSOLE,
    DECISION,
    DELTAS,
    FAILURE_LABELS,
    FIT_COLUMNS,
    FIT_KEYS,
    FULL,
    GROUP,
    HARDLY,
    KEY_LABELS,
    METHOD,
    OTHER_SETTINGS,
    PEFT_COLUMNS,
    PEFT_DECISION,
    PEFT_SETTINGS,
    PLAN_COLUMNS,
    PLAN_DEFAULTS,
    PLAN_KEYS,
    RATES,
    RECIPE,
    SEEDS,
    TASK_COLUMNS,
    TASKS,
    VARIANTS,
)


def task_of(jobs: pd.DataFrame) -> pd.Series:
    """Each row's task (param `task`): a run without the param is a classifier's."""
    if "task" not in jobs:
        return pd.Series(CLASSIFICATION, index=jobs.index, dtype=object)
    return jobs["task"].astype(object).where(jobs["task"].notna(), CLASSIFICATION)


def has_lm(jobs: pd.DataFrame) -> bool:
    """Whether some row is a language model's (task=causal_lm): its tables then carry the task."""
    return bool(task_of(jobs).eq(CAUSAL_LM).any())


def with_task(jobs: pd.DataFrame) -> pd.DataFrame:
    """`jobs` with every row's task filled in, where some row is a language model's (else as they are)."""
    return jobs.assign(task=task_of(jobs)) if has_lm(jobs) else jobs


def tasks_in(frame: pd.DataFrame) -> list[str]:
    """The tasks of a frame's rows, in the report's order (classification first)."""
    found = set(task_of(frame))
    return [t for t in TASKS if t in found] + sorted(found - set(TASKS))


def by_task(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """The frame's rows task by task (classification first), each without the columns of the other tasks'
    quality (and their std): one table per task, with no column its rows cannot fill."""
    tasks = task_of(frame)
    parts = []
    for task in tasks_in(frame):
        other = [c for t, cs in TASK_COLUMNS.items() if t != task for c in cs]
        other += [COLLAPSED] if task == CAUSAL_LM else [HARDLY]
        drop = [c for c in frame if c in other or c.removesuffix(" std") in other]
        parts.append((task, frame[tasks.eq(task)].drop(columns=drop).reset_index(drop=True)))
    return parts


def task_title(task: str) -> str:
    """A task's table heading: `language model (task=causal_lm)`."""
    return f"{TASKS.get(task, task)} (task={task})"


def method_of(jobs: pd.DataFrame) -> pd.Series:
    """Each row's method (param `method`: `full`, `lora r=16`, ...): a run without the param is `full`."""
    if METHOD not in jobs:
        return pd.Series(FULL, index=jobs.index, dtype=object)
    return jobs[METHOD].astype(object).where(jobs[METHOD].notna(), FULL)


def has_peft(jobs: pd.DataFrame) -> bool:
    """Whether some row trains otherwise than in full (LoRA, QLoRA): its tables then carry the method."""
    return bool(method_of(jobs).ne(FULL).any())


def with_method(jobs: pd.DataFrame) -> pd.DataFrame:
    """`jobs` with every row's method filled in, where some row is not full fine-tuning (else as they are)."""
    return jobs.assign(**{METHOD: method_of(jobs)}) if has_peft(jobs) else jobs


def split_baseline(baseline: str) -> tuple[str, str]:
    """`--baseline` as (optimizer, method): `adamw` is AdamW's full fine-tuning, `adamw lora r=16` its LoRA."""
    optim, _, method = str(baseline).strip().partition(" ")
    return optim, method.strip() or FULL


def is_baseline(frame: pd.DataFrame, baseline: str) -> pd.Series:
    """The rows of `frame` that are the baseline: its optimizer, with its method (`full` unless named)."""
    optim, method = split_baseline(baseline)
    return frame.optim.eq(optim) & (method_of(frame).eq(method) if METHOD in frame else method == FULL)


def own_baseline(jobs: pd.DataFrame, baseline: str) -> str:
    """`baseline` where one of `jobs` is it, else theirs: the optimizer and method most of them ran (the first
    of those ties), as --baseline names it (a sweep of LoRA runs alone: `adamw lora r=16`)."""
    if jobs.empty or "optim" not in jobs or is_baseline(jobs, baseline).any():
        return baseline
    optim, method = jobs.optim.astype(str), method_of(jobs)
    ways = optim.where(method.eq(FULL), optim + " " + method)
    return str(ways.value_counts(sort=True).index[0])


def row_keys(points: list[str]) -> list[str]:
    """A row's keys from its point (point_columns): the point, the optimizer, then the method and the adapters'
    settings where they are keys."""
    own = [METHOD, *PEFT_SETTINGS]
    return [c for c in points if c not in own] + ["optim"] + [c for c in points if c in own]


def comparison_group(keys: list[str]) -> list[str]:
    """What Δ compares within: a row's keys less the optimizer, the method and the adapters' settings (the
    baseline is one optimizer with one method)."""
    return [c for c in keys if c not in ("optim", METHOD, *PEFT_SETTINGS)]


def _method_rank(method: str) -> tuple:
    """full first, then LoRA, then QLoRA, each by rank (r=8 before r=16), then the rest by name."""
    kind, _, rest = str(method).partition(" ")
    r = rest.split(" ")[0].removeprefix("r=")
    return ({FULL: 0, "lora": 1, "qlora": 2}.get(kind, 3), kind, int(r) if r.isdigit() else 0, str(method))


def method_order(methods) -> list[str]:
    return sorted(set(methods), key=_method_rank)


def point_columns(jobs: pd.DataFrame) -> list[str]:
    """What makes a comparison row besides the optimizer: the task where some row is a language model's, the
    group, plus any other setting the jobs vary, and the method where some row is not full fine-tuning. A
    learning rate counts only where one optimizer (with one method) ran at several: optimizers each at their
    own reference rate are still compared in one row each."""
    jobs = with_method(with_task(jobs))
    lead = ["task"] if "task" in jobs and has_lm(jobs) else []
    varied = [c for c in OTHER_SETTINGS if c in jobs and jobs[c].nunique(dropna=False) > 1]
    peft = [METHOD] if has_peft(jobs) else []
    if peft:  # the adapters' settings a sweep varies within one model (its default targets differ by family)
        within_model = lambda c: jobs.groupby("model", dropna=False)[c].nunique().gt(1).any()  # noqa: E731
        peft += [c for c in PEFT_SETTINGS if c in jobs and within_model(c)]
    # the rest of the point and the optimizer: does the rate vary within them, or only between optimizers?
    keys = [c for c in [*lead, *GROUP, *varied, *peft, "optim"] if c in jobs and c not in RATES]
    within = lambda c: jobs.groupby(keys, dropna=False)[c].nunique(dropna=False).gt(1).any()  # noqa: E731
    return lead + GROUP + [c for c in varied if c not in RATES or not keys or within(c)] + peft


def _optimizer_order(optims, baseline: str) -> list[str]:
    """The baseline's optimizer first (`--baseline "adamw lora r=16"`: adamw), then the others by name."""
    first = split_baseline(baseline)[0]
    return sorted(set(optims), key=lambda o: (o != first, str(o)))


def compare(jobs: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """The comparison table as numbers: one row per point, seeds aggregated; `<col> std` beside each mean."""
    columns = list(dict.fromkeys([*jobs.columns, *GROUP, "optim"]))  # a key no job logged stays empty
    done = with_method(with_task(jobs[jobs.status == "FINISHED"].reindex(columns=columns)))
    keys = row_keys(point_columns(done))
    # with PEFT runs among them: the trainable count and the frozen weights (a full row's count: its model's)
    figures = {**COLUMNS, **(PEFT_COLUMNS if METHOD in keys else {})}
    values = done.reindex(columns=list(figures.values())).astype(float)
    values.columns = list(figures)
    if METHOD in keys:
        whole = done.reindex(columns=["model_num_params"]).model_num_params.astype(float)
        values["trainable params"] = values["trainable params"].fillna(whole.where(done[METHOD].eq(FULL)))
    grouped = pd.concat([done[keys], values], axis=1).groupby(keys, dropna=False)
    # runs whose predictions fell (nearly) all in one class (tag `collapsed`): their quality figures are the
    # class balance's, not a trained model's
    collapsed = done.collapsed.astype("boolean").fillna(False).astype(int) if "collapsed" in done else 0
    runs_collapsed = done[keys].assign(c=collapsed).groupby(keys, dropna=False).c.sum().rename(COLLAPSED)
    # a language model's runs whose loss stayed near a uniform guess's (metric loss_vs_uniform)
    hardly = done.reindex(columns=["loss_vs_uniform"]).loss_vs_uniform.astype(float).ge(HARDLY_LEARNED)
    runs_hardly = done[keys].assign(c=hardly.astype(int)).groupby(keys, dropna=False).c.sum().rename(HARDLY)
    table = pd.concat(
        [
            grouped.size().rename(SEEDS),
            runs_collapsed,
            runs_hardly,
            grouped.mean(),
            grouped.std(ddof=1).add_suffix(" std"),
        ],
        axis=1,
    ).reset_index()
    rate = []
    if "lr" not in keys and done.lr.nunique() > 1:
        # the rows ran at different rates (each optimizer at its own): the rate is a column, so the table
        # never reads as a comparison at one rate
        rate = ["lr"]
        table = table.merge(done.groupby(keys, dropna=False).lr.first().reset_index(), on=keys, how="left")
    # Δ against the baseline of the same group: the baseline optimizer's full fine-tuning unless `baseline`
    # names a method (empty where the group has no finished baseline)
    group, by = comparison_group(keys), keys
    # (a baseline named with a method whose adapters' settings vary: its first row)
    baselines = table[is_baseline(table, baseline)].drop_duplicates(group)
    at_scale = [k for k in group if k != "lr"]
    if {"lr", "lr_scale"} <= set(group) and not baselines.duplicated(at_scale).any():
        # a tuned grid: Δ at the same lr scale (optimizers with their own reference rates rarely share an
        # lr), those rows side by side, each optimizer's own lr last
        group, by = at_scale, [*at_scale, *[k for k in keys if k in ("optim", METHOD)], "lr"]
    reference = table[group].join(baselines.set_index(group)[list(DELTAS.values())], on=group)
    for name, column in DELTAS.items():
        table[f"Δ {name} [MB]"] = table[column] - reference[column]
        table[f"Δ {name} [%]"] = 100 * (table[column] - reference[column]) / reference[column]
    if "optim_variant" in done and done.optim_variant.isin(list(VARIANTS)).any():
        # an optimizer the Trainer runs otherwise than the plain one: its variant, named beside it
        label = done.optim_variant.map(lambda v: VARIANTS[v][0] if v in VARIANTS else "")
        variant = done[keys].assign(variant=label).groupby(keys, dropna=False).variant.first()
        table = table.merge(variant.reset_index(), on=keys, how="left")
    table["optim"] = pd.Categorical(table.optim, _optimizer_order(table.optim, baseline))
    if "task" in keys:  # classification's rows first, then the language model's
        table["task"] = pd.Categorical(table.task, tasks_in(table))
    if METHOD in keys:  # each optimizer's full fine-tuning first, then LoRA, then QLoRA
        table[METHOD] = pd.Categorical(table[METHOD], method_order(table[METHOD]))
    table = table.sort_values(by, ignore_index=True)
    table["optim"] = table.optim.astype(str)
    if "task" in keys:
        table["task"] = table.task.astype(str)
    if METHOD in keys:
        table[METHOD] = table[METHOD].astype(str)
    # the quality columns of the tasks the table holds: a classifier's table has no perplexity, a language
    # model's no F1 (and no row of it can collapse to one class)
    present = tasks_in(table) or [CLASSIFICATION]
    absent = [c for t in TASK_COLUMNS if t not in present for c in TASK_COLUMNS[t]]
    table = table.drop(columns=[*absent, *[f"{c} std" for c in absent]])
    if present == [CAUSAL_LM]:
        table = table.drop(columns=COLLAPSED)
    elif "task" in keys:
        table[COLLAPSED] = table[COLLAPSED].where(table.task.ne(CAUSAL_LM))
        table[HARDLY] = table[HARDLY].where(table.task.eq(CAUSAL_LM))
    if CAUSAL_LM not in present:
        table = table.drop(columns=HARDLY)
    order = [
        *keys,
        *rate,
        "variant",
        SEEDS,
        COLLAPSED,
        HARDLY,
        *PEFT_COLUMNS,
        "state [MB]",
        "estimated state [MB]",
        "Δ state [MB]",
        "Δ state [%]",
        "peak [MB]",
    ]
    order += ["Δ peak [MB]", "Δ peak [%]", *list(COLUMNS)[3:]]
    return table[[c for column in order for c in (column, f"{column} std") if c in table]]


def pareto_front(
    table: pd.DataFrame, x: str = "peak [MB]", y: str = "eval F1 [0-1]", lower: bool = False
) -> pd.Series:
    """Rows no other row beats: none has x <= and y >= with one of them strict (less memory, higher F1);
    `lower`: y is better when lower (a language model's perplexity or loss), none has y <= instead. A row
    with a collapsed run (COLLAPSED) is never on the front: its quality is the class balance's."""
    points = table.dropna(subset=[x, y])
    if COLLAPSED in points:
        points = points[points[COLLAPSED].fillna(0).eq(0)]
    px, py = points[x].to_numpy(), points[y].to_numpy() * (-1 if lower else 1)
    # [i, j]: row j is at least as good as row i on both and better on one
    beats = (px <= px[:, None]) & (py >= py[:, None]) & ((px < px[:, None]) | (py > py[:, None]))
    return pd.Series(~beats.any(axis=1), index=points.index).reindex(table.index, fill_value=False)


# a row's marks: the column counting its marked runs -> (the mark, what it means under the table)
MARKS = {
    COLLAPSED: (
        "collapsed",
        "the run's predictions fell (nearly) all in one class (tag `collapsed`, eval.collapse_share): its F1 and "
        "accuracy measure the class balance, not a trained model",
    ),
    HARDLY: (
        "hardly learned",
        f"the run's final loss is at least {HARDLY_LEARNED:.0%} of a uniform guess's, ln(vocabulary) (metric "
        "`loss_vs_uniform`, tag `hardly_learned`): it has hardly left its start",
    ),
}


def collapsed_mark(marked: int, runs: int, mark: str = "collapsed") -> str:
    """`collapsed` when every run of a row is so marked, else `collapsed 1 of 3`."""
    return mark if marked >= runs else f"{mark} {int(marked)} of {int(runs)}"


def collapsed_note(table: pd.DataFrame) -> str | None:
    """The lines under a table whose rows carry a mark (`(collapsed)`, `(hardly learned)`); None without."""
    said = [
        f"({mark}): {meaning}"
        for column, (mark, meaning) in MARKS.items()
        if column in table and table[column].fillna(0).gt(0).any()
    ]
    return "\n".join(said) or None


def _fmt(value, spec: str = ".4g") -> str:
    return "" if pd.isna(value) else format(value, spec)


def format_table(table: pd.DataFrame, columns=None) -> pd.DataFrame:
    """Strings for people: 4 significant digits, ± std (2 digits) where there is a std, empty where nothing
    was measured."""
    keys = [c for c in table if c in ["task", *GROUP, *OTHER_SETTINGS, "optim", METHOD, *PEFT_SETTINGS]]
    out = table[keys].rename(columns=KEY_LABELS)
    for setting in [c for c in keys if c in PEFT_SETTINGS]:  # a full fine-tuning row has none: empty
        out[KEY_LABELS[setting]] = table[setting].astype(object).where(table[setting].notna(), "")
    if "variant" in table:  # the Trainer's variant beside the optimizer: `adamw_8bit (Trainer: ...)`
        optimizer = KEY_LABELS["optim"]
        out[optimizer] = [
            f"{o} ({v})" if isinstance(v, str) and v else o
            for o, v in zip(out[optimizer], table.variant, strict=True)
        ]
    for column, (mark, _) in MARKS.items():  # `adamw (collapsed)` wherever it shows
        if column in table and table[column].fillna(0).gt(0).any():
            optimizer = KEY_LABELS["optim"]
            out[optimizer] = [
                f"{o} ({collapsed_mark(c, n, mark)})" if c > 0 else o
                for o, c, n in zip(out[optimizer], table[column].fillna(0), table[SEEDS], strict=True)
            ]
    out[SEEDS] = table[SEEDS]
    after = table.columns[table.columns.get_loc(SEEDS) + 1 :]
    for column in columns or [c for c in after if not c.endswith(" std") and c not in MARKS]:
        # a change in percent to two decimals (-99.77, -0.00, +0.00), any other change to 4 digits with its sign
        spec = (
            "+.2f"
            if column.startswith("Δ") and column.endswith("[%]")
            else "+.4g"
            if column.startswith("Δ")
            else ".4g"
        )
        std = table.get(f"{column} std", pd.Series(float("nan"), index=table.index))
        # a perplexity in the thousands as a whole number (30,295), not 3.03e+04; a count of parameters whole
        shown = (
            _readable
            if "perplexity" in column
            else _count
            if column in COUNTS
            else lambda m, spec=spec: _fmt(m, spec)
        )
        out[column] = [
            shown(m) + (f" ± {_fmt(s, '.2g')}" if pd.notna(s) else "")
            for m, s in zip(table[column], std, strict=True)
        ]
    return out


def decision_table(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The comparison at a glance: optimizer first, then the settings that differ between rows (the method
    first among them), n and the DECISION columns (with PEFT runs, the trainable count before them); and the
    line naming the settings every row shares (`every row: model tiny, ...`)."""
    shown = format_table(table, [c for c in [*PEFT_DECISION, *DECISION] if c in table])
    optimizer, keys = KEY_LABELS["optim"], list(shown.columns[: list(shown.columns).index(SEEDS)])
    varied = [k for k in keys if k != optimizer and shown[k].nunique(dropna=False) > 1]
    varied = sorted(varied, key=lambda k: k != METHOD)
    shared = [k for k in keys if k not in (optimizer, *varied)]
    note = ", ".join(f"{k} {shown[k].iloc[0]}" for k in shared) if len(shown) else ""
    lead = shown[[optimizer, *varied, *[c for c in shown.columns if c not in keys]]]
    return lead, f"every row: {note}" if note else ""


def peak_phase(table: pd.DataFrame) -> pd.Series:
    """When the peak fell, as the parts at its moment tell it (a PHASES key; '' where they do not): no
    gradient yet -> forward (or early backward), activations freed with gradients held -> the optimizer step,
    both held -> backward. The tracker records the parts at the peak, not the phase itself."""
    acts = table["peak: activations [MB]"].astype(float)
    if "peak: logits [MB]" in table:  # a language model's logits (or their gradients) live as activations do
        acts = acts + table["peak: logits [MB]"].astype(float).fillna(0)
    grads = table["peak: gradients [MB]"].astype(float)
    phase = pd.Series("", index=table.index)
    phase[grads.le(0) & acts.gt(0)] = "forward"
    phase[grads.gt(0) & acts.le(0)] = "step"
    phase[grads.gt(0) & acts.gt(0)] = "backward"
    return phase


def failed_table(jobs: pd.DataFrame) -> pd.DataFrame:
    columns = [
        "run_name",
        "optim",
        "model",
        "batch_size",
        "backend",
        "seed",
        "status",
        "failure_reason",
        "error",
    ]
    if has_peft(jobs):  # the method beside the optimizer
        columns.insert(columns.index("optim") + 1, METHOD)
    failed = with_method(jobs).loc[jobs.status != "FINISHED"].reindex(columns=columns)
    failed["failure_reason"] = failed.failure_reason.map(lambda r: FAILURE_LABELS.get(r, r))
    return failed.rename(columns={"run_name": "run", "failure_reason": "why", **KEY_LABELS}).fillna("")


def is_fit_job(jobs: pd.DataFrame) -> pd.Series:
    """Jobs run with find_batch_size=true: they search a batch size instead of training."""
    return jobs["max_batch_size"].notna() if "max_batch_size" in jobs else pd.Series(False, index=jobs.index)


def fit_table(jobs: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """Largest batch that fits the memory budget, per optimizer (and method, with PEFT runs among them; seeds:
    the smallest found)."""
    fits = with_method(jobs[is_fit_job(jobs) & (jobs.status == "FINISHED")])
    keys = [*FIT_KEYS, METHOD] if has_peft(fits) else FIT_KEYS
    done = fits.reindex(columns=list(dict.fromkeys([*keys, *FIT_COLUMNS.values()])))
    if done.empty:
        return pd.DataFrame()
    values = done[list(FIT_COLUMNS.values())].astype(float).set_axis(list(FIT_COLUMNS), axis=1)
    table = pd.concat([done[keys], values], axis=1).groupby(keys, dropna=False).min().reset_index()
    table["optim"] = pd.Categorical(table.optim, _optimizer_order(table.optim, baseline))
    if METHOD in keys:
        table[METHOD] = pd.Categorical(table[METHOD], method_order(table[METHOD]))
    table = table.sort_values(keys, ignore_index=True)
    table["optim"] = table.optim.astype(str)
    if METHOD in keys:
        table[METHOD] = table[METHOD].astype(str)
    labels = {**KEY_LABELS, "memory_budget_mb": "budget [MB]"}
    return table.rename(columns=labels)


def is_plan_job(jobs: pd.DataFrame) -> pd.Series:
    """Jobs run with plan=true: they predict a training step's memory instead of training."""
    column = "predicted_peak_params_mb"
    return jobs[column].notna() if column in jobs else pd.Series(False, index=jobs.index)


def plan_table(jobs: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """The plan: a training step's predicted parts and peak per optimizer x model x precision (x batch,
    checkpointing, device), whether it fits, the largest batch that does, beside the rules of thumb."""
    plans = with_method(jobs[is_plan_job(jobs) & (jobs.status == "FINISHED")])
    method = [METHOD] if METHOD in plans else []  # where some plan is of adapters (LoRA, QLoRA): after optim
    done = plans.reindex(columns=list(dict.fromkeys([*PLAN_KEYS, *method, *PLAN_COLUMNS.values()])))
    if done.empty:
        return pd.DataFrame()
    values = done[list(PLAN_COLUMNS.values())].astype(float).set_axis(list(PLAN_COLUMNS), axis=1)
    values["fits"] = values["fits"].map({1.0: "yes", 0.0: "no"})
    levers = sorted(
        c for c in plans if c.startswith("lever_")
    )  # what each lever makes of a point: the verdict's
    values[levers] = plans[levers].astype(float)
    # the recipe where the plan searched one (pipeline.recipe): what the verdict names first
    values[[c for c in RECIPE if c in plans]] = plans[[c for c in RECIPE if c in plans]]
    keys = [
        k
        for k in PLAN_KEYS
        if done[k].notna().any() and not (done[k].astype(str) == PLAN_DEFAULTS.get(k, "\0")).all()
    ] + method
    table = pd.concat([done[keys], values], axis=1).dropna(axis=1, how="all")
    if "world_size" in table:  # a param: text; ranks sort as numbers
        table["world_size"] = table.world_size.astype(int)
    table["optim"] = pd.Categorical(table.optim, _optimizer_order(table.optim, baseline))
    if "sharding" in table:  # from the least sharded to the most
        table["sharding"] = pd.Categorical(table.sharding, ["none", "zero1", "zero2", "fsdp"])
    if method:
        table[METHOD] = pd.Categorical(table[METHOD], method_order(table[METHOD]))
    table = table.sort_values(keys, ignore_index=True)
    table["optim"] = table.optim.astype(str)
    if "sharding" in table:
        table["sharding"] = table.sharding.astype(str)
    if method:
        table[METHOD] = table[METHOD].astype(str)
    labels = {**KEY_LABELS, "gradient_checkpointing": "checkpointing", "world_size": "ranks"}
    return table.rename(columns=labels)


def console_table(table: pd.DataFrame) -> str:
    """The short table printed at the end of a sweep; where a language model is among the rows, one table per
    task, each headed by it (`language model (task=causal_lm):`) and with its own quality columns."""
    if not has_lm(table):
        return format_table(table, [c for c in CONSOLE if c in table]).to_string(index=False)
    return "\n\n".join(
        f"{task_title(task)}:\n"
        + format_table(rows, [c for c in CONSOLE if c in rows]).to_string(index=False)
        for task, rows in by_task(table)
    )


def _plain(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.map(lambda v: _fmt(v) if isinstance(v, float) else v)


# the columns that count things: whole numbers with thousands separators (20,480), however large
COUNTS = ["trainable params"]


def _count(value) -> str:
    return "" if pd.isna(value) else f"{value:,.0f}"


def _readable(value) -> str:
    """Large MB figures as whole numbers with thousands separators (143,210), small ones to 4 digits."""
    return "" if pd.isna(value) else f"{value:,.0f}" if abs(value) >= 1000 else _fmt(value)


def plan_display(plans: pd.DataFrame) -> pd.DataFrame:
    """A plan table as shown: its figures readable, without the levers' and the recipe's (the verdict says
    them)."""
    plans = plans.drop(columns=[c for c in plans if c.startswith(("lever_", "recipe"))])
    return plans.map(lambda v: _readable(v) if isinstance(v, float) else v)
