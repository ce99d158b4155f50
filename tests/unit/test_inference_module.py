"""InferenceModule: tokenloom's layers are called straight through their forward, nn.Module otherwise intact."""
import torch
from torch import nn

from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.norm import GemmaRMSNorm, RMSNorm


class Scale(InferenceModule):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)

    def forward(self, x):
        return x * self.weight


class Shift(Scale):
    def forward(self, x):
        return x + self.weight


def test_calling_a_module_runs_its_forward():
    x = torch.ones(3)
    assert torch.equal(Scale()(x), torch.full((3,), 2.0))


def test_a_subclass_is_called_through_its_own_forward():
    x = torch.ones(3)
    assert torch.equal(Shift()(x), torch.full((3,), 3.0))
    assert GemmaRMSNorm.__call__ is GemmaRMSNorm.forward and RMSNorm.__call__ is RMSNorm.forward


def test_the_call_skips_nn_modules_hook_dispatch():
    assert Scale.__call__ is not nn.Module.__call__
    calls = []
    handle = nn.modules.module.register_module_forward_hook(lambda *args: calls.append(args))
    try:
        Scale()(torch.ones(3))
    finally:
        handle.remove()
    assert calls == []


def test_parameters_state_dict_and_children_work_as_in_nn_module():
    outer = nn.Sequential(Scale(), Shift())
    assert [name for name, _ in outer.named_parameters()] == ["0.weight", "1.weight"]
    assert set(outer.state_dict()) == {"0.weight", "1.weight"}
    assert torch.equal(outer(torch.ones(3)), torch.full((3,), 4.0))
