"""Muon for recipes/cifar.py's `--preset muon` (airbench94_muon, Keller Jordan): the conv filters step along the
orthogonalized momentum (Newton-Schulz), every other parameter takes Nesterov SGD. One torch optimizer, so that the
Trainer prepares, skips, schedules and checkpoints it as any other: its state is a momentum buffer per parameter
(tensors), its param groups plain values (`muon`: which rule a group follows), which the checkpoint's JSON and
safetensors hold as they are.
"""

import torch
from torch.optim.sgd import sgd

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # airbench94_muon's quintic coefficients


def newton_schulz(g, steps=3, eps=1e-7):
    """airbench94_muon's `zeropower_via_newtonschulz5`: something like U S' V^T of g = U S V^T, S' ~ Uniform(0.5,
    1.5) (the coefficients maximise the slope at zero rather than converge to 1), in bf16."""
    a, b, c = NEWTON_SCHULZ
    x = g.bfloat16()
    x = x / (x.norm() + eps)  # the top singular value at most 1
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


_COMPILED = {}


def _orthogonalize(device_type: str, compiled: bool):
    """newton_schulz, compiled by torch.compile on a CUDA device when asked (airbench94_muon compiles it: a few
    small matmuls and elementwise kernels per filter, launches a GPU would wait for), once per process."""
    if not (compiled and device_type == "cuda"):
        return newton_schulz
    if "cuda" not in _COMPILED:
        _COMPILED["cuda"] = torch.compile(newton_schulz)
    return _COMPILED["cuda"]


def state_like_params(optimizer) -> None:
    """After a load: each state tensor of a parameter's shape in that parameter's memory layout. torch's fused
    optimizers step over a parameter, its gradient and its state as flat memory, so a state in another layout (a
    checkpoint's tensors come back contiguous; the convs' weights are channels_last) is silently mixed up: a
    resumed run trained on other numbers (tests/test_cifar.py). load_state_dict keeps dtype and device, not
    layout."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


class Muon(torch.optim.Optimizer):
    """Param groups with `muon: True` take airbench94_muon's Muon step: Nesterov momentum, the weight rescaled to a
    norm of sqrt(its first dimension), then a step of `lr` along the orthogonalized update (its size does not
    depend on the loss's scale, so a mean loss trains as airbench's summed one). The others take torch's SGD
    (`sgd`, fused where `self.fused` is set) with their lr, momentum, Nesterov and weight decay. No step is skipped on the
    device (GradScaler and --nan_policy skip decide from the host, as for any optimizer that takes no skip flag)."""

    def __init__(self, params, lr, momentum, nesterov=True, fused=None, compiled=False):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0, muon=False)
        super().__init__(params, defaults)
        # Not in the param groups: a checkpoint's are the same on any device and launch.
        self.fused, self.compiled = fused, compiled

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        state_like_params(self)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            buffers = [self.state[p].get("momentum_buffer") for p in params]
            if group["muon"]:
                self._muon(group, params, grads, buffers)
            else:
                sgd(params, grads, buffers, weight_decay=group["weight_decay"], momentum=group["momentum"],
                    lr=group["lr"], dampening=0.0, nesterov=group["nesterov"], maximize=False,
                    fused=self.fused)  # fmt: skip
            for p, buffer in zip(params, buffers):
                self.state[p]["momentum_buffer"] = buffer
        return loss

    def _muon(self, group, params, grads, buffers):
        momentum, lr = group["momentum"], group["lr"]
        for i, g in enumerate(grads):
            if buffers[i] is None:
                buffers[i] = torch.zeros_like(g)
        torch._foreach_mul_(buffers, momentum)
        torch._foreach_add_(buffers, grads)
        updates = torch._foreach_add(grads, buffers, alpha=momentum) if group["nesterov"] else buffers
        orthogonalize = _orthogonalize(params[0].device.type, self.compiled)
        for p, u in zip(params, updates):
            p.mul_(len(p) ** 0.5 / p.norm())  # the weight's norm fixed: only its direction trains
            p.add_(orthogonalize(u.reshape(len(u), -1)).reshape(u.shape), alpha=-lr)
