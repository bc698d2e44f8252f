"""The summary of a GPU check (bench/gpu_check.py): each step's result and each check's, measured against
expected, the sweeps' and real-size jobs' figures as a table, and the section of docs/gpu.md that a run whose
every check passed on a GPU rewrites."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "gpu.md"
START, END = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"


def status(run) -> str:
    """A run's status and its failure reason: `FAILED (oom)`."""
    reason = run.data.tags.get("failure_reason")
    return run.info.status + (f" ({reason})" if reason else "")


COLUMNS = {  # summary column <- MLflow metric
    "state [MB]": "optimizer_state_mb",
    "estimate [MB]": "estimated_optimizer_state_mb",
    "peak [MB]": "peak_memory_mb",
    "reserved [MB]": "peak_memory_reserved_mb",
    "breakdown [MB]": "peak_breakdown_mb",
    "untracked [MB]": "peak_untracked_mb",
    "predicted [MB]": "predicted_peak_mb",
    "prediction error [%]": "predicted_peak_error_pct",
    "samples/s": "train_samples_per_second",
    "warm-up [s]": "train_warmup_s",
}


def figure_rows(runs: list, step: str = "sweep") -> list[dict]:
    """A sweep's jobs: status, backend, optimizer (and a real-size point's method, precision and batch) and the
    figures of COLUMNS."""
    rows = []
    for r in runs:
        row = {"step": step} if step != "sweep" else {}
        row |= {
            "backend": r.data.params.get("backend"),
            "optim": r.data.params.get("optim"),
            **{k: r.data.params.get(k) for k in ("method", "precision", "batch_size") if step != "sweep"},
            "status": status(r),
        }
        row |= {col: r.data.metrics.get(key) for col, key in COLUMNS.items()}
        row["breakdown"] = r.data.tags.get("peak_breakdown", "")
        rows.append(row)
    order = ("step", "backend", "optim", "method", "precision")
    return sorted(
        rows, key=lambda row: (*(str(row.get(k, "")) for k in order), int(row.get("batch_size") or 0))
    )


def markdown(rows: list[dict], first: str | None = None) -> list[str]:
    if not rows:
        return ["(none)"]
    every = [first] if first else []
    every += [c for row in rows for c in row if c != first]
    columns = [c for c in dict.fromkeys(every) if any(row.get(c) not in (None, "") for row in rows)]

    def cell(v) -> str:
        if v is None:
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "/")

    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]


def result(ok: bool | None) -> str:
    return {True: "ok", False: "FAILED", None: "skipped"}[ok]


def write_docs(page: Path, text: str) -> bool:
    """Put `text` between the gpu-check markers of `page`; False when the page has no such section."""
    content = page.read_text() if page.exists() else ""
    if START not in content or END not in content:
        return False
    head, rest = content.split(START, 1)
    page.write_text(head + START + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return True


def summary_text(
    header: str, steps: list, checks: list, figures: list[dict], sets: list[str], failed: int
) -> str:
    """The summary: `header`, the steps (step, ok, seconds, note, time-out), the overrides every sweep had
    (`sets`), the checks, the jobs' figures, and how many failed."""
    lines = [
        header,
        "",
        "| step | what | result | seconds | time-out [s] |",
        "| --- | --- | --- | --- | --- |",
        *[
            f"| {s.name} | {s.what} | {result(ok)} ({note}) | {seconds:.0f} | {timeout:.0f} |"
            for s, ok, seconds, note, timeout in steps
        ],
        "",
        *([f"Every sweep also had `{' '.join(sets)}` (--set).", ""] if sets else []),
        "| check | result | measured | expected |",
        "| --- | --- | --- | --- |",
        *[f"| {c.name} | {result(c.ok)} | {c.measured} | {c.expected} |" for c in checks],
        "",
        "Sweep and real-size jobs (MB = 2^20 bytes; peak = `torch.cuda.max_memory_allocated` on CUDA, the tensor "
        "tracker's peak on CPU; reserved = `max_memory_reserved`; untracked = what the allocator held at step 2's "
        "start outside the tensors the breakdown tracks):",
        "",
        *markdown(figures, "step" if any("step" in row for row in figures) else None),
        "",
        f"**{'all checks passed' if not failed else f'{failed} failed'}**",
    ]
    return "\n".join(lines)
