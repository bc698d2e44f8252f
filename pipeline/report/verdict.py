"""The verdict of a plan table in lines a person reads: which optimizers fit the budget and how large a batch,
how many ranks each needs, and, for one that does not fit, its recipe or the levers that lower its peak; and
the plan as the console shows it."""

from __future__ import annotations

import math

import pandas as pd

from pipeline.levers import LEVERS, SMALLER_BATCH
from pipeline.report.columns import FULL, KEY_LABELS, METHOD
from pipeline.report.tables import _readable, plan_display


def _ranks_phrase(rows: pd.DataFrame) -> str:
    """How one optimizer fits: `fits on 1`, `needs 2 with zero2 or fsdp (largest batch there 13/rank)`."""
    need = rows.dropna(subset=["ranks needed"])
    if need.empty:
        return "fits on no number of ranks tried (up to 4096)"
    n = int(need["ranks needed"].min())
    best = need[need["ranks needed"] == n].sort_values("largest batch there [samples]", ascending=False)
    batch = int(best["largest batch there [samples]"].iloc[0])
    if n == 1:
        return f"fits on 1 (largest batch {batch}/rank)"
    if "sharding" not in best:
        return f"needs {n} (largest batch there {batch}/rank)"
    each = best.drop_duplicates("sharding")
    ways = " or ".join(
        f"{s} ({int(b)}/rank)"
        for s, b in zip(each["sharding"], each["largest batch there [samples]"], strict=True)
    )
    return f"needs {n} with {ways}"


def ranks_verdict(table: pd.DataFrame) -> list[str]:
    """One line per model x device x batch of a plan table that names a budget, and per setting that differs
    between its rows (precision, checkpointing, length: the conditions the answer holds for): per optimizer,
    the smallest number of ranks that fits the batch (over the shardings planned) and the largest batch per
    rank there; where no sharding planned can fit at any number of ranks (DDP replicates the whole step),
    which fit at the ranks planned (fit_verdict)."""
    if "ranks needed" not in table or "largest batch there [samples]" not in table:
        return fit_verdict(table)
    # the named GPU where one was named (the column is empty where the budget is memory_budget_mb)
    named = "device_memory" in table and table["device_memory"].notna().any()
    where = "device_memory" if named else "budget [MB]"
    batch = KEY_LABELS["batch_size"]
    settings = table.columns[: table.columns.get_loc(KEY_LABELS["optim"])]
    conditions = [
        c
        for c in settings
        if c not in ("model", where, batch, "sharding", "ranks") and table[c].nunique(dropna=False) > 1
    ]
    group = [k for k in ("model", where, batch) if k in table] + conditions
    lines = []
    for key, rows in table.groupby(group, sort=False, dropna=False):
        key = dict(zip(group, key if isinstance(key, tuple) else (key,), strict=True))
        on = key.get("device_memory") or f"{key.get('budget [MB]', 0):,.0f} MB"
        head = f"{key.get('model', '')} on {on}" + (f", batch {int(key[batch])}/rank" if batch in key else "")
        head += f" ({', '.join(f'{c} {key[c]}' for c in conditions)})" if conditions else ""
        each = [f"{o} {_ranks_phrase(r)}" for o, r in rows.groupby(_way(rows), sort=False)]
        lines.append(f"{head}: " + "; ".join(each))
    return lines


def _way(plan):
    """How a plan row (a Series) or each row of a plan table (a DataFrame) trains, as a verdict names it and
    `--baseline` takes it: the optimizer (`adamw`), and the method besides full fine-tuning (`adamw lora r=16`)."""
    optim = plan[KEY_LABELS["optim"]]
    if METHOD not in plan:
        return optim if isinstance(plan, pd.DataFrame) else str(optim)
    if isinstance(plan, pd.DataFrame):
        return optim.where(plan[METHOD].eq(FULL), optim + " " + plan[METHOD])
    return str(optim) if plan[METHOD] == FULL else f"{optim} {plan[METHOD]}"


def plan_verdict(plans: pd.DataFrame) -> list[str]:
    """The verdict after a plan table: for a plan over ranks or shardings (its table has their columns), the
    smallest number of ranks each optimizer needs (`ranks_verdict`); else which fit the budget (`fit_verdict`)."""
    if "world_size" in plans or "sharding" in plans:
        return ranks_verdict(plans)
    return fit_verdict(plans)


def _left(row) -> str:
    """What the budget leaves beside a row's predicted peak: `913 MB, 1.2% left` (short: `short by 2,345 MB`)."""
    mb, pct = row.get("headroom [MB]"), row.get("headroom [%]")
    if mb is None or pd.isna(mb):
        return ""
    if mb < 0:
        return f"short by {_readable(-mb)} MB"
    return f"{_readable(mb)} MB, {pct:.1f}% left"


def _lever_figure(row, name: str, what: str):
    value = row.get(f"lever_{name}_{what}")
    return None if value is None or pd.isna(value) else float(value)


def lever_phrase(row) -> str:
    """The levers that help a plan row that does not fit, as its plan weighed them (pipeline.levers): those
    that fit (a smaller batch first, then by their peak, sharding last), each with its peak or the largest
    batch it fits and its risk; then those that help but not alone, each with what it saves. A lever whose
    peak is no lower is not named."""
    peak, budget = row["predicted peak [MB]"], row["budget [MB]"]
    fit, short = [], []
    largest = row.get("largest batch [samples]")
    if largest is not None and pd.notna(largest) and largest >= 1:
        fit.append((-1.0, f"{SMALLER_BATCH.command.format(batch=int(largest))} ({SMALLER_BATCH.risk})"))
    for name, lever in LEVERS.items():
        ranks = _lever_figure(row, name, "ranks")
        if ranks is not None:  # a sharding: the smallest number of GPUs that fits, and the batch there
            n, batch = int(ranks), int(_lever_figure(row, name, "max_batch_size") or 0)
            said = f"largest batch {batch}/GPU; {lever.risk.format(ranks=n)}"
            fit.append((math.inf, f"{lever.command.format(ranks=n)} ({said})"))
            continue
        mb = _lever_figure(row, name, "peak_mb")
        if mb is None or mb >= peak:
            continue
        if mb <= budget:
            batch = int(_lever_figure(row, name, "max_batch_size") or 0)
            fit.append((mb, f"{lever.command} ({_readable(mb)} MB, largest batch {batch}; {lever.risk})"))
        else:
            short.append(
                f"{lever.command} (saves {_readable(peak - mb)} MB, short by {_readable(mb - budget)} MB)"
            )
    if not fit:
        return (
            f"no lever alone; these help: {'; '.join(short)}" if short else "no lever weighed lowers its peak"
        )
    said = "; ".join(text for _, text in sorted(fit, key=lambda f: f[0]))
    return said + (f". Not enough alone: {'; '.join(short)}" if short else "")


def recipe_phrase(row) -> str | None:
    """A plan row's recipe in a few words: `train.precision=bf16_pure ... (keeps the math: in_backward;
    approximates it: bf16_pure; 61,639 MB, largest batch 1)`, or that no combination fits and the smallest peak
    the search found; then the GPUs a sharding would need. None for a row planned without a recipe."""
    recipe = row.get("recipe")
    if not isinstance(recipe, str):
        return None
    peak, budget = row.get("recipe_peak_mb"), row["budget [MB]"]
    if recipe == "none":
        said = "no combination of the levers fits"
        if peak is not None and pd.notna(peak):
            said += (
                f" (the smallest peak found, {_readable(peak)} MB, is short by {_readable(peak - budget)} MB)"
            )
        else:
            said += " (none lowers its peak)"
    else:
        batch = int(row.get("recipe_max_batch_size") or 0)
        said = f"{recipe} ({row.get('recipe_kinds')}; {_readable(peak)} MB, largest batch {batch})"
    for name in ("fsdp", "zero1"):
        ranks = _lever_figure(row, name, "ranks")
        if ranks is not None:
            said += f"; or {int(ranks)} GPUs with train.sharding={name}"
    return said


def fit_verdict(plans: pd.DataFrame) -> list[str]:
    """One line per planned setting (model, precision, batch, device ... besides the optimizer) with a budget:
    `fits h100-80gb at batch 4: adafactor (largest 76; 40,201 MB, 53.0% left), adamw_8bit (42; ...); does not
    fit: adamw (short by 1,234 MB)`, and where one does not fit, the levers that could make it."""
    if plans.empty or "fits" not in plans:
        return []
    optimizer, batch = KEY_LABELS["optim"], KEY_LABELS["batch_size"]
    largest = "largest batch [samples]"
    keys = [
        c for c in plans.columns[: plans.columns.get_loc(optimizer)] if plans[c].nunique(dropna=False) > 1
    ]
    lines = []
    for _, rows in plans.groupby(keys, dropna=False, sort=False) if keys else [((), plans)]:
        first = rows.iloc[0]
        device = first.get("device_memory")
        where = device if isinstance(device, str) else f"{_readable(first['budget [MB]'])} MB"
        setting = ", ".join(f"{k} {first[k]}" for k in keys if k != batch)
        fit = rows[rows.fits.eq("yes")]
        if largest in rows and fit[largest].notna().any():
            fit = fit.sort_values(largest, ascending=False, kind="stable")
        sizes = []
        for i, (_, row) in enumerate(fit.iterrows()):
            n = row.get(largest)
            said = [f"{'largest ' if i == 0 else ''}{int(n)}" if pd.notna(n) else "", _left(row)]
            said = "; ".join(x for x in said if x)
            sizes.append(f"{_way(row)} ({said})" if said else _way(row))
        lead = f"fits {where} at batch {first[batch]}" + (f" ({setting})" if setting else "")
        no = rows[rows.fits.ne("yes")]
        short = [f"{_way(row)} ({_left(row)})" if _left(row) else _way(row) for _, row in no.iterrows()]
        line = f"{lead}: {', '.join(sizes) or 'none'}" + (
            f"; does not fit: {', '.join(short)}" if short else ""
        )
        for _, row in no.iterrows():
            line += f". To fit {_way(row)}: {recipe_phrase(row) or lever_phrase(row)}"
        lines.append(line)
    return lines


# what a language model's plan table says of its logits part (`logits [MB]`), in its note
LOGITS_PART = (
    "logits: a language model's LM-head output, the loss's fp32 copy and log-softmax and their gradients, "
    "taken out of activations and other, so that the parts add up to the predicted peak"
)

# the plan table's rules of thumb (Adam's, whatever the optimizer) and the model's size: said below the
# console's table, once per model, instead of as columns repeating one figure per optimizer
ANCHORS = ["ZeRO formula, Adam [MB]", "accelerate estimate, Adam [MB]", "18 bytes/param, Adam [MB]"]


def _span(values: pd.Series) -> str:
    """`61,264`, or `30,632-61,264` where the figure differs between rows (ranks, sharding, batch)."""
    low, high = values.min(), values.max()
    return _readable(high) if low == high else f"{_readable(low)}-{_readable(high)}"


def plan_console(plans: pd.DataFrame) -> str:
    """What the console shows of a plan: its table (less the per-model figures), the verdict lines, the model's
    parameter count and the field's rules of thumb for it, and what the parts are."""
    shown = plans.drop(columns=[c for c in [*ANCHORS, "parameters"] if c in plans])
    lines = [plan_display(shown).to_string(index=False)]
    lines += [f"verdict: {line}" for line in plan_verdict(plans)]
    model = "model" if "model" in plans else None
    for _, rows in plans.groupby(model, sort=False) if model else [(None, plans)]:
        first = rows.iloc[0]
        name = f"{first['model']}: " if model else ""
        if "parameters" in rows and pd.notna(first["parameters"]):
            n = first["parameters"]
            said = f"{name}{n:,.0f} parameters ({n / 1e9:.2f} B)"
            anchors = [(a, rows[a]) for a in ANCHORS if a in rows and rows[a].notna().any()]
            if anchors:
                said += "; the field's rules of thumb, Adam's state whatever the optimizer: " + ", ".join(
                    f"{a.split(',')[0]} {_span(v)} MB" for a, v in anchors
                )
            lines.append(said)
    parts = (
        "(parts: what memory holds at the moment of the predicted peak, not each part's own largest: at a peak in "
        "backward the gradients made so far, not all of them; MB = 2^20 bytes)"
    )
    if "logits [MB]" in plans:  # a language model's plan
        parts = parts.removesuffix(")") + f"; {LOGITS_PART})"
    lines.append(parts)
    return "\n".join(lines)
