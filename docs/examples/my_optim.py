"""A researcher's own optimizer, outside the package: signSGD with momentum (one buffer per parameter).

    PYTHONPATH=docs/examples python -m pipeline -m optim=adamw,sign_sgd \
        'hydra.searchpath=[file://docs/examples/conf]' model=tiny train.max_steps=2
"""

import torch


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-4, momentum=0.9, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(buf.sign(), alpha=-group["lr"])
