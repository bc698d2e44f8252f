import pytest
import torch
from transformers import Trainer, TrainingArguments

from pipeline import models, optimizers
from tests.conftest import compose_cfg


@pytest.mark.parametrize("optim", list(optimizers.REGISTRY))
def test_same_optimizer_and_settings_on_both_backends(optim, tmp_path):
    """The Trainer's optim= string and the registry factory build the same class with the same settings."""
    cfg = compose_cfg("model=tiny", f"optim={optim}", "train.weight_decay=0.01")
    model = models.load_model(cfg.model, num_labels=2)
    spec = optimizers.get(optim)
    betas = cfg.optim.get("betas") or (0.9, 0.999)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        optim=spec.trainer_optim,
        learning_rate=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_epsilon=cfg.optim.get("eps") or 1e-8,
        report_to="none",
        use_cpu=True,
    )
    from_trainer = Trainer(model=model, args=args).create_optimizer()
    direct = spec.build(optimizers.param_groups(model, cfg.train.weight_decay), cfg)
    assert type(from_trainer) is type(direct)
    assert from_trainer.defaults == direct.defaults
    assert len(from_trainer.param_groups) == len(direct.param_groups)
    for a, b in zip(from_trainer.param_groups, direct.param_groups, strict=True):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}


def test_unknown_optimizer_lists_the_choices():
    with pytest.raises(KeyError, match="adafactor"):
        optimizers.get("adamx")


def test_param_layout_skips_frozen_parameters():
    layer = torch.nn.Linear(3, 2)
    layer.bias.requires_grad_(False)
    assert optimizers.param_layout(layer.parameters()) == [((2, 3), 4)]
