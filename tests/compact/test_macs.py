"""prunekit.compact.count_macs: exact counts for Linear, Conv2d and routed experts, dense and counting only
non-zero weights."""

import pytest
import torch
from torch import nn

import prunekit
from prunekit.compact import count_macs

pytestmark = pytest.mark.usefixtures("one_thread")


def _zero_some(w: torch.Tensor, every: int) -> int:
    """Zero every ``every``-th weight (flat order); returns how many weights stay non-zero."""
    with torch.no_grad():
        w.view(-1)[::every] = 0
    return int((w != 0).sum())


def test_linear_dense_and_effective():
    torch.manual_seed(0)
    fc = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert count_macs(fc, x) == 3 * 4 * 8 == count_macs(fc, x, effective=True)
    nnz = _zero_some(fc.weight, 3)
    assert nnz == 32 - 11
    assert count_macs(fc, x) == 96  # every weight is read
    assert count_macs(fc, x, effective=True) == 3 * nnz  # each of the 3 rows reads the 21 non-zero weights
    # a sequence input: every one of the 2 x 5 positions reads every non-zero weight
    assert count_macs(fc, torch.randn(2, 5, 8), effective=True) == 10 * nnz
    assert count_macs(fc, torch.randn(2, 5, 8)) == 10 * 32


@pytest.mark.parametrize("groups, stride", [(1, 1), (3, 2)])
def test_conv2d_dense_and_effective(groups, stride):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 9, 3, padding=1, stride=stride, groups=groups)
    x = torch.randn(2, 6, 7, 7)
    hw = 7 if stride == 1 else 4  # output side: (7 + 2 - 3) // stride + 1
    positions = 2 * hw * hw
    dense = positions * 9 * (6 // groups) * 3 * 3
    assert count_macs(conv, x) == dense == count_macs(conv, x, effective=True)
    nnz = _zero_some(conv.weight, 4)
    assert nnz == conv.weight.numel() - (conv.weight.numel() + 3) // 4
    assert count_macs(conv, x) == dense
    assert count_macs(conv, x, effective=True) == positions * nnz
    # an unbatched input (C, H, W) has hw * hw positions
    assert count_macs(conv, x[0], effective=True) == hw * hw * nnz


def test_pruned_modules_count_their_effective_weight_and_whole_models_add_up():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    x = torch.randn(5, 1, 8, 8)
    prunekit.l1_unstructured(model[0], "weight", amount=10)  # 26 of 36 weights left, read at 5 x 36 positions
    prunekit.l1_unstructured(model[3], "weight", amount=0.75)  # 360 of 1440 weights left, read once per image
    assert count_macs(model, x) == 5 * 36 * 36 + 5 * 1440
    assert count_macs(model, x, effective=True) == 5 * 36 * 26 + 5 * 360
    # the same with the masks baked in: the zeros are what is counted, not the mask machinery
    for m in (model[0], model[3]):
        prunekit.remove(m, "weight")
    assert count_macs(model, x, effective=True) == 5 * 36 * 26 + 5 * 360


def test_matmul_counts_in_full_either_way():
    class Bilinear(nn.Module):
        def forward(self, a, b):
            return a @ b

    a, b = torch.zeros(3, 4), torch.randn(4, 5)
    assert count_macs(Bilinear(), (a, b)) == count_macs(Bilinear(), (a, b), effective=True) == 3 * 5 * 4


def test_conv_transpose_counts_nonzero_weights_per_input_element():
    # ConvTranspose2d(4 -> 6, 3x3): every input element of channel c meets the 6 x 3 x 3 weights w[c]
    layer = nn.ConvTranspose2d(4, 6, 3, bias=False)
    x = torch.randn(2, 4, 5, 5)
    assert count_macs(layer, x) == 2 * 4 * 5 * 5 * 6 * 9
    with torch.no_grad():
        layer.weight[1:3] = 0  # input channels 1 and 2 read no weight
        layer.weight[0, :, 0, 0] = 0  # and channel 0 six fewer
    nonzero = 4 * 54 - 2 * 54 - 6
    assert int(torch.count_nonzero(layer.weight)) == nonzero
    assert count_macs(layer, x, effective=True) == 2 * 5 * 5 * nonzero
    assert count_macs(layer, x) == 2 * 4 * 5 * 5 * 6 * 9  # the dense count ignores zeros


# ------------------------------------------------------------ routed experts (transformers' 3-D layout)
E, H, I = 4, 8, 6  # noqa: E741 - experts, hidden size, expert FFN size
# top-2 choices of 5 tokens: expert 0 gets 3 tokens, 1 gets 3, 2 gets 2, 3 gets 2
ROUTING = torch.tensor([[0, 1], [0, 2], [3, 1], [0, 1], [2, 3]])


class LoopExperts(nn.Module):
    """Experts with transformers' 3-D layout and a plain per-expert loop of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, k = torch.where(top_k_index == e)
            gate, up = nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = nn.functional.linear(nn.functional.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, k, None])
        return out


def _inputs():
    return (torch.randn(5, H), ROUTING, torch.full((5, 2), 0.5))


def test_routed_experts_count_the_tokens_each_expert_receives():
    experts = LoopExperts()
    per_token = 2 * I * H + H * I  # gate/up rows, then down rows, for one token
    assert count_macs(experts, _inputs()) == 10 * per_token
    assert count_macs(experts, _inputs(), effective=True) == 10 * per_token
    # effective: expert 1's gate/up weights are masked, and half of expert 2's down_proj
    mask = torch.ones(E, 2 * I, H)
    mask[1] = 0
    prunekit.custom_from_mask(experts, "gate_up_proj", mask)
    with torch.no_grad():
        experts.down_proj[2, :, : I // 2] = 0
    assert count_macs(experts, _inputs()) == 10 * per_token  # every weight still counts without effective
    assert count_macs(experts, _inputs(), effective=True) == 10 * per_token - 3 * 2 * I * H - 2 * H * (I // 2)


def test_an_expert_without_tokens_costs_nothing_and_unknown_indices_run_nowhere():
    experts = LoopExperts()
    x, _, w = _inputs()
    only_zero = torch.tensor([[0, E], [0, E], [0, E], [0, E], [0, E]])  # E: a slot routed to no local expert
    per_token = 2 * I * H + H * I
    assert count_macs(experts, (x, only_zero, w)) == 5 * per_token
