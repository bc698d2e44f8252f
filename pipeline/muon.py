"""Muon for the 2-D hidden weights and AdamW for every other parameter, as one optimizer object.

`torch.optim.Muon` takes 2-D parameters only; embeddings, the classification head, biases and LayerNorm go to
`torch.optim.AdamW` beside it. The two share this object's `param_groups` (the schedule and the Trainer see
every group) and its `state` (the accounting sees both parts), and `step()` steps both. Each parameter group
says which part steps it (`use_muon`), as in Keller Jordan's `MuonWithAuxAdam`.

`adjust_lr_fn="match_rms_adamw"` scales Muon's update to the RMS of an AdamW update (0.2 * sqrt(max(A, B)) for
an A x B weight, Moonshot's rule), so one learning rate serves both parts and AdamW's carries over.
"""

from __future__ import annotations

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ):
        groups = [dict(g) for g in params]
        muon_groups = [{k: v for k, v in g.items() if k != "use_muon"} for g in groups if g.get("use_muon")]
        adamw_groups = [
            {k: v for k, v in g.items() if k != "use_muon"} for g in groups if not g.get("use_muon")
        ]
        muon_groups = [g for g in muon_groups if g["params"]]
        adamw_groups = [g for g in adamw_groups if g["params"]]
        self.muon = torch.optim.Muon(
            muon_groups,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        self.adamw = torch.optim.AdamW(
            adamw_groups, lr=lr, betas=adamw_betas, eps=adamw_eps, weight_decay=weight_decay
        )
        for g in self.muon.param_groups:
            g["use_muon"] = True
        for g in self.adamw.param_groups:
            g["use_muon"] = False
        # the parts' own group dicts (add_param_group keeps the dict it is given): a change of lr reaches both
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self.defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
        }
        self.muon.state = self.adamw.state = self.state  # one state: both parts' entries

    def __setstate__(self, state: dict) -> None:
        """`load_state_dict` ends here with a new state dict and new group dicts (accelerate's `prepare` reloads
        an optimizer's own state dict to place it on the device): the parts take them over, or their steps
        would fill a dict nothing counts and miss the schedule's rates."""
        super().__setstate__(state)
        if "muon" in self.__dict__:
            n = len(self.muon.param_groups)
            self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
            self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss
