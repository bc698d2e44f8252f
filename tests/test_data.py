import json

import pandas as pd
import pytest

from pipeline import data, models
from tests.conftest import compose_cfg

ROWS = {
    "text": ["good film", "bad film", "great", "awful", "fine", "boring"],
    "sentiment": ["pos", "neg", "pos", "neg", "pos", "neg"],
}


def test_rotten_tomatoes_split_is_clean_and_deterministic():
    cfg = compose_cfg().data
    a, b = data.load_splits(cfg), data.load_splits(cfg)
    assert a.label_names == ["rotten", "fresh"]
    assert a.train["text"][:50] == b.train["text"][:50]
    frame, _ = data.rotten_tomatoes_frame()
    assert frame["text"].is_unique
    assert set(frame["label"]) == {"fresh", "rotten"}  # plot summaries dropped
    assert not set(a.train["text"]) & set(a.eval["text"])
    assert len(a.eval) == cfg.max_eval_samples
    assert set(a.eval["label"]) == {0, 1}


def test_bbc_news_has_five_topics():
    splits = data.load_splits(compose_cfg("data=bbc_news").data)
    assert splits.num_labels == 5
    assert len(splits.train) + len(splits.val) + len(splits.eval) == 2225


def write(frame: pd.DataFrame, path):
    {
        ".csv": lambda: frame.to_csv(path, index=False),
        ".jsonl": lambda: frame.to_json(path, orient="records", lines=True),
        ".parquet": lambda: frame.to_parquet(path),
    }[path.suffix]()
    return str(path)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_local_files_with_string_labels(tmp_path, suffix):
    frame = pd.DataFrame(ROWS)
    cfg = compose_cfg(
        "data=csv",
        f"data.train_file={write(frame, tmp_path / ('train' + suffix))}",
        f"data.eval_file={write(frame.iloc[:2], tmp_path / ('eval' + suffix))}",
        "data.label_column=sentiment",
        "data.val_fraction=0",  # no validation split: the training rows stay as written
    ).data
    splits = data.load_splits(cfg)
    assert splits.val is None
    assert splits.label_names == ["neg", "pos"]
    assert splits.train["label"] == [1, 0, 1, 0, 1, 0]
    assert splits.eval["text"] == ["good film", "bad film"]


def test_missing_column_is_named(tmp_path):
    path = write(pd.DataFrame(ROWS), tmp_path / "train.csv")
    cfg = compose_cfg("data=csv", f"data.train_file={path}", f"data.eval_file={path}").data
    with pytest.raises(
        ValueError, match=r"\['label'\] not found; the data has columns \['text', 'sentiment'\]"
    ):
        data.load_splits(cfg)


def test_eval_label_unseen_in_training(tmp_path):
    frame = pd.DataFrame(ROWS)
    other = frame.assign(sentiment=["meh"] * 6)
    cfg = compose_cfg(
        "data=csv",
        f"data.train_file={write(frame, tmp_path / 'train.csv')}",
        f"data.eval_file={write(other, tmp_path / 'eval.csv')}",
        "data.label_column=sentiment",
    ).data
    with pytest.raises(ValueError, match="among the training labels"):
        data.load_splits(cfg)


def test_hub_loader_on_a_local_dataset_folder(tmp_path):
    """The hub code path (datasets.load_dataset(path, name)) on a local folder laid out like a hub dataset."""
    (tmp_path / "train.jsonl").write_text(
        "\n".join(json.dumps({"sentence": t, "label": i % 2}) for i, t in enumerate(ROWS["text"]))
    )
    (tmp_path / "validation.jsonl").write_text(json.dumps({"sentence": "ok", "label": 1}))
    cfg = compose_cfg(
        "data=glue_sst2", f"data.path={tmp_path}", "data.subset=null", "data.val_fraction=0"
    ).data
    splits = data.load_splits(cfg)
    assert len(splits.train) == 6 and splits.eval["text"] == ["ok"]
    assert splits.label_names == ["0", "1"]


def test_tokenize_truncates_and_maps_ids_beyond_the_model_vocabulary():
    cfg = compose_cfg("data.max_eval_samples=8", "data.max_train_samples=8")
    tokenizer = models.load_tokenizer(cfg.model)
    splits = data.load_splits(cfg.data)
    out = data.tokenize(splits, tokenizer, max_length=12, vocab_size=1000)
    ids = [i for row in out.train["input_ids"] for i in row]
    assert max(len(row) for row in out.train["input_ids"]) <= 12
    assert max(ids) < 1000
    assert out.train["labels"] == splits.train["label"]
