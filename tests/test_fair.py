"""A comparison is fair or says it is not, replayed through the real CLI: the rate each row ran at is a column
where the rows differ in it, one line names the optimizers run off a tuned reference rate, and a row whose
runs collapsed to one class is marked."""

import re

import pandas as pd
import pytest

from pipeline import MB
from pipeline.runner import config_hash
from tests.conftest import compose_cfg, run_cli, sweep_runs

QUICK = ["model=tiny", "train.max_steps=2", "data.max_train_samples=64", "data.max_eval_samples=16"]
QUICK += ["data.max_val_samples=16", "backend=accelerator"]


@pytest.fixture(scope="module")
def adamw_and_custom(tmp_path_factory):
    """AdamW at its tuned reference rate beside a torch optimizer of the user's choice, named on the command
    line (optim=custom custom_optim=torch.optim.NAdam: a custom optimizer at its untuned 5e-5)."""
    tmp = tmp_path_factory.mktemp("fair")
    proc = run_cli(tmp, "-m", "optim=adamw,custom", "custom_optim=torch.optim.NAdam", *QUICK)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return tmp, proc


def test_a_class_named_on_the_command_line_runs_under_its_own_name(adamw_and_custom):
    tmp, proc = adamw_and_custom
    runs = {r.data.params["optim"]: r for r in sweep_runs(tmp)[1]}
    assert set(runs) == {"adamw", "NAdam"}
    nadam = runs["NAdam"]
    assert nadam.info.run_name.startswith("NAdam-tiny-") and "[job] NAdam-tiny-" in proc.stdout
    assert nadam.data.params["optim_target"] == "torch.optim.NAdam"
    # measured as any other; estimated by the meta-device step, to the byte (two moments and a step each)
    metrics = nadam.data.metrics
    assert metrics["optimizer_state_bytes"] == pytest.approx(metrics["estimated_optimizer_state_mb"] * MB)
    # AdamW's point is the one an AdamW-only sweep records: custom_optim selects nothing there
    assert runs["adamw"].data.tags["config_hash"] == config_hash(compose_cfg(*QUICK))


@pytest.mark.parametrize(
    "args, ran",
    [
        (["optim=adamw"], "adamw"),  # a single run
        (["-m", "optim=adamw,sgd"], "adamw,sgd"),
        (["-m"], "adamw"),  # the default optimizer
    ],
)
def test_a_custom_optimizer_no_run_uses_is_one_line_not_ignored(args, ran, tmp_path):
    proc = run_cli(tmp_path, *args, "custom_optim=torch.optim.NAdam", *QUICK)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"error: custom_optim=torch.optim.NAdam is set, but no run uses it (optim={ran}): put the custom "
        f"optimizer beside the others, optim={ran},custom"
    )
    assert list(tmp_path.iterdir()) == []  # before any run opened, any folder made


def test_the_rate_is_a_column_where_rows_differ_and_one_line_names_the_untuned(adamw_and_custom):
    tmp, proc = adamw_and_custom
    runs = {r.data.params["optim"]: r for r in sweep_runs(tmp)[1]}
    rates = {optim: float(r.data.params["lr"]) for optim, r in runs.items()}
    assert rates == {"adamw": 1.58e-4, "NAdam": 5e-5}  # conf/optim/{adamw,custom}.yaml
    assert (
        runs["adamw"].data.params["lr_tuned"] == "True" and runs["NAdam"].data.params["lr_tuned"] == "False"
    )
    out = proc.stdout
    header = next(line for line in out.splitlines() if "optimizer" in line and "state [MB]" in line)
    assert re.search(r"\blr\b", header), header
    for (
        optim,
        lr,
    ) in rates.items():  # the rate just after the optimizer (and its mark), as the console prints it
        shown = re.search(rf"\b{optim}(?: \([^)]*\))?\s+([\d.e-]+)\s", out)
        assert shown and float(shown[1]) == lr, (optim, out[-3000:])
    line = "off a tuned learning rate: NAdam at 5e-05 (its reference, untuned)"
    assert out.count(line) == 1, out[-3000:]
    report = next(tmp.glob("report/*/comparison.csv"))
    assert dict(zip(*pd.read_csv(report)[["optimizer", "lr"]].T.to_numpy(), strict=True)) == rates
    assert line in (report.parent / "report.md").read_text()


def test_a_collapsed_row_is_marked_as_its_tags_say(adamw_and_custom):
    tmp, proc = adamw_and_custom
    runs = {r.data.params["optim"]: r for r in sweep_runs(tmp)[1]}
    table = pd.read_csv(next(tmp.glob("report/*/comparison.csv"))).set_index("optimizer")
    for optim, run in runs.items():
        collapsed = run.data.tags["collapsed"] == "true"
        assert table.loc[optim, "collapsed [runs]"] == int(collapsed)
        assert (f"{optim} (collapsed)" in proc.stdout) == collapsed, proc.stdout[-3000:]
