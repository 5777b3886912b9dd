"""Neural Compressor users' configs and scripts, unchanged apart from the import, on prunekit's pruners."""

import logging
import os
import math
import textwrap

import pytest
import torch
from torch import nn

import prunekit
from prunekit.compat import neural_compressor as nc
from prunekit.compat.neural_compressor import Pruning, WeightPruningConfig, prepare_compression, prepare_pruning
from prunekit.kernels.patterns import get_pattern
from prunekit.training.schedules import get_scheduler


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ a ResNet-18-shaped model
class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (module names, blocks, kernels, strides, downsampling), a quarter as
    wide (16..128 channels instead of 64..512) to keep the tests fast."""

    def __init__(self, num_classes=10, widths=(16, 32, 64, 128)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def batches(n, seed=0, size=2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


# the YAML of Neural Compressor's own test for its experimental PyTorch pruner
NC1_YAML = """
model: {name: imagenet_prune, framework: pytorch}
pruning:
  approach:
    weight_compression_pytorch:
      initial_sparsity: 0.0
      target_sparsity: 0.9
      start_step: 0
      end_step: 10
      excluded_names: ["classifier"]
      update_frequency_on_step: 1
      sparsity_decay_type: "exp"
      pruners:
        - !Pruner
            prune_type: "magnitude"
            names: ['layer1.*']
            extra_excluded_names: ['layer2.*']
            prune_domain: "global"
            pattern: "tile_pattern_4x1"
        - !Pruner
            start_step: 1
            end_step: 1
            target_sparsity: 0.5
            prune_type: "snip_momentum"
            update_frequency: 2
            names: ['layer2.*']
            prune_domain: local
            pattern: "tile_pattern_2:4"
"""


def masked_layers(model):
    return sorted(n for n, m in model.named_modules() if hasattr(m, "weight_mask"))


def assert_exact_block_sparsity(pruner, pattern, target):
    units = zero_units = 0
    for mask in pruner.masks.values():
        pruned = get_pattern(pattern).unit_pruned(mask)
        units += pruned.numel()
        zero_units += int(pruned.sum())
        assert torch.equal(mask, get_pattern(pattern).expand(~pruned, mask.shape).to(mask.dtype))  # whole blocks
    assert zero_units == round(target * units), (zero_units, units)


def assert_n_in_m(mask, kept, m):
    groups = prunekit.kernels.patterns.to_2d(mask).reshape(-1, m)
    assert torch.equal((groups != 0).sum(1), torch.full((groups.shape[0],), kept))


def assert_pruned_entries_zero(model):
    for n, m in model.named_modules():
        if hasattr(m, "weight_mask"):
            pruned = m.weight_mask == 0
            assert int(pruned.sum()) > 0, n
            assert torch.equal(m.weight[pruned], torch.zeros(int(pruned.sum()))), n
            assert torch.equal(m.weight_orig[pruned], torch.zeros(int(pruned.sum()))), n


def test_v1_pruning_flow_on_resnet18_with_neural_compressors_yaml(tmp_path, caplog):
    (tmp_path / "fake.yaml").write_text(NC1_YAML)
    torch.manual_seed(0)
    model = ResNet18()
    # --- Neural Compressor's script, unchanged apart from the import -----------------------------
    caplog.set_level(logging.WARNING, logger="prunekit")
    prune = Pruning(str(tmp_path / "fake.yaml"))
    prune.model = model
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0001, momentum=0.9)
    prune.on_train_begin()
    masks_after_step = []
    for epoch in range(2):
        model.train()
        prune.on_epoch_begin(epoch)
        local_step = 0
        for image, target in batches(6, seed=epoch):
            prune.on_step_begin(local_step)
            output = model(image)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            prune.on_before_optimizer_step()
            optimizer.step()
            prune.on_after_optimizer_step()
            prune.on_step_end()
            local_step += 1
            masks_after_step.append({n: m.weight_mask.clone() for n, m in model.named_modules()
                                     if hasattr(m, "weight_mask")})
        prune.on_epoch_end()
    prune.on_train_end()
    # -----------------------------------------------------------------------------------------------
    assert "update_frequency=2 is ignored" in caplog.text  # accepted, never used by Neural Compressor either
    layer1 = [f"layer1.{b}.conv{c}" for b in (0, 1) for c in (1, 2)]
    layer2 = [f"layer2.{b}.conv{c}" for b in (0, 1) for c in (1, 2)] + ["layer2.0.downsample.0"]
    assert masked_layers(model) == sorted(layer1 + layer2)
    first, second = prune.pruners
    assert sorted(first.modules) == sorted(layer1) and sorted(second.modules) == sorted(layer2)
    assert first.config.pattern == "4x1" and first.config.prune_domain == "global"
    assert second.config.pattern == "2:4" and second.config.prune_domain == "local"
    # the first pruner: exactly 90% of its 4x1 blocks (global), reached at step 10
    assert_exact_block_sparsity(first, "4x1", 0.9)
    # the second: 2:4 in every layer (Neural Compressor's "2:4" prunes 2 of 4, as prunekit's keeps 2), one-shot at step 1
    for n in layer2:
        assert_n_in_m(model.get_submodule(n).weight_mask, 2, 4)
    assert all(torch.equal(masks_after_step[1][n], masks_after_step[-1][n]) for n in layer2)
    assert all(int((masks_after_step[0][n] == 0).sum()) == 0 for n in layer2)
    assert all(torch.equal(masks_after_step[10][n], masks_after_step[-1][n]) for n in layer1)
    assert not torch.equal(masks_after_step[9]["layer1.0.conv1"], masks_after_step[10]["layer1.0.conv1"])
    # pruned weights stayed zero (effective and stored), through the momentum steps after the last update
    assert_pruned_entries_zero(model)
    # Neural Compressor's three figures
    zeros = sum(int((m.weight_mask == 0).sum()) for m in model.modules() if hasattr(m, "weight_mask"))
    lc = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    params = sum(p.numel() for p in model.parameters())
    n1 = sum(model.get_submodule(n).weight.numel() for n in layer1)
    blocks = int(n1 * (round(0.9 * n1 / 4) / (n1 / 4))) + zeros - int(sum((first.masks[n] == 0).sum() for n in layer1))
    assert prune.get_sparsity_ratio() == pytest.approx((zeros / lc, zeros / params, blocks / lc), abs=1e-12)


def test_v2_weight_pruning_config_and_prepare_pruning_flow(caplog):
    torch.manual_seed(0)
    model = ResNet18()
    # --- a Neural Compressor 2.x script, unchanged apart from the import -------------------------
    configs = [
        {"op_names": ["layer3.*"], "pattern": "4x1", "target_sparsity": 0.8, "pruning_scope": "global"},
        {"op_names": ["layer4.0.conv1"], "pattern": "2:4", "target_sparsity": 0.5, "pruning_type": "magnitude"},
        {"op_names": ["fc"], "pattern": "1x1", "target_sparsity": 0.5},
    ]
    config = WeightPruningConfig(configs, pruning_type="snip_momentum", start_step=1, end_step=6,
                                 pruning_frequency=2, sparsity_decay_type="cube", excluded_op_names=["downsample"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-3)
    criterion = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"pruners\[2\]: excluded_op_names=\['downsample', '\^fc\$'\].* exclude all 1 layers .*\['fc'\]"):
        prepare_pruning(model, config, optimizer)  # fc is the final classifier: 2.x leaves it alone
    assert not prunekit.is_pruned(model)
    config = WeightPruningConfig(configs[:2], pruning_type="snip_momentum", start_step=1, end_step=6,
                                 pruning_frequency=2, sparsity_decay_type="cube", excluded_op_names=["downsample"])
    prepare_pruning(model, config, optimizer)
    for image, target in batches(9):
        optimizer.zero_grad()
        criterion(model(image), target).backward()
        optimizer.step()
    # -----------------------------------------------------------------------------------------------
    layer3 = [f"layer3.{b}.conv{c}" for b in (0, 1) for c in (1, 2)]
    assert masked_layers(model) == sorted(layer3 + ["layer4.0.conv1"])
    units = zero = 0
    for n in layer3:
        pruned = get_pattern("4x1").unit_pruned(model.get_submodule(n).weight_mask)
        units += pruned.numel()
        zero += int(pruned.sum())
    assert zero == round(0.8 * units)
    assert_n_in_m(model.get_submodule("layer4.0.conv1").weight_mask, 2, 4)
    # zero and staying zero: momentum and weight decay are cleared at pruned entries
    assert_pruned_entries_zero(model)


def test_prunekits_own_prepare_pruning_takes_a_weight_pruning_config():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    cb = prunekit.prepare_pruning(model, WeightPruningConfig(pruning_type="magnitude", pattern="1x1",
                                                             target_sparsity=0.5))
    cb.on_step_begin(0)
    cb.on_step_end()
    assert masked_layers(model) == ["0", "2"]  # "4", the classifier, is left alone as in Neural Compressor 2.x
    assert int((model[0].weight == 0).sum() + (model[2].weight == 0).sum()) == (128 + 256) // 2


def test_prepare_compression_flow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    manager = prepare_compression(model, WeightPruningConfig(pruning_type="snip_momentum", pattern="1x1",
                                                             target_sparsity=0.75, start_step=1, end_step=4))
    assert manager.model is model
    manager.callbacks.on_train_begin()
    for epoch in range(2):
        manager.callbacks.on_epoch_begin(epoch)
        for i in range(3):
            manager.callbacks.on_step_begin(i)
            x = torch.randn(4, 8)
            loss = manager.callbacks.on_after_compute_loss(x, model(x), model(x).pow(2).mean())
            loss.backward()
            manager.callbacks.on_before_optimizer_step()
            optimizer.step()
            optimizer.zero_grad()
            manager.callbacks.on_step_end()
        manager.callbacks.on_epoch_end()
    manager.callbacks.on_train_end()
    assert int((model[0].weight == 0).sum() + (model[2].weight == 0).sum()) == round(0.75 * (128 + 256))
    assert_pruned_entries_zero(model)  # no optimizer is known: on_step_end re-masks, as Neural Compressor did


# ------------------------------------------------------------------ every key takes effect
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


def run(config, steps=1, layout=None):
    """Drive ``Pruning(config)`` on ``Small`` for ``steps`` training steps; return (prune, model, sparsity per step)."""
    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prune = Pruning(nc.load_config(config, layout))
    prune.model = model
    prune.on_train_begin()
    history = []
    for s in range(steps):
        prune.on_step_begin(s)
        opt.zero_grad()
        model(torch.randn(2, 4, 6, 6)).pow(2).mean().backward()
        prune.on_before_optimizer_step()
        opt.step()
        prune.on_after_optimizer_step()
        prune.on_step_end()
        layers = {n: float((m.weight_mask == 0).float().mean()) for n, m in model.named_modules()
                  if hasattr(m, "weight_mask")}
        history.append(layers)
        prune.totals = getattr(prune, "totals", []) + [total_sparsity(model)]
    return prune, model, history


def total_sparsity(model):
    zeros = sum(int((m.weight_mask == 0).sum()) for m in model.modules() if hasattr(m, "weight_mask"))
    numel = sum(m.weight_mask.numel() for m in model.modules() if hasattr(m, "weight_mask"))
    return zeros / numel


V1 = {"prune_type": "magnitude", "pattern": "tile_pattern_1x1", "target_sparsity": 0.5}
V2 = {"pruning_type": "magnitude", "pattern": "1x1", "target_sparsity": 0.5, "pruning_configs": [{}]}


def _groups(mask, m):
    return prunekit.kernels.patterns.to_2d(mask).reshape(-1, m)


def check_prune_type(prune, model, hist, log):
    assert type(prune.pruners[0]).__name__ == "SnipPruner"


def check_pattern_nxm(prune, model, hist, log):
    g = prunekit.kernels.patterns.to_2d(model.fc1.weight_mask).reshape(-1, 4)  # 1x4: four input weights
    assert set((g != 0).sum(1).tolist()) == {0, 4}


def check_pattern_nm(prune, model, hist, log):  # Neural Compressor's 1:4 prunes 1 of 4 = prunekit's 3:4
    for m in (model.fc1, model.fc2, model.conv2):
        assert set((_groups(m.weight_mask, 4) != 0).sum(1).tolist()) == {3}


def check_target(prune, model, hist, log):
    assert total_sparsity(model) == pytest.approx(0.25, abs=1e-9)


def check_local(prune, model, hist, log):
    assert all(v == pytest.approx(0.5, abs=0.02) for v in hist[-1].values())


def check_global(prune, model, hist, log):
    assert len({round(v, 2) for v in hist[-1].values()}) > 1 and total_sparsity(model) == pytest.approx(0.5, abs=1e-3)


def check_start_step(prune, model, hist, log):
    assert hist[0] and all(v == 0 for v in hist[0].values()) and all(v == 0 for v in hist[1].values())
    assert total_sparsity(model) == pytest.approx(0.5, abs=1e-3)


def check_end_step(prune, model, hist, log):
    sched = get_scheduler(0, 3, 0.5, "exp")
    for step in range(4):
        assert prune.totals[step] == pytest.approx(sched.sparsity(step), abs=2e-3)
    assert prune.totals[2] < prune.totals[3] == pytest.approx(0.5, abs=2e-3)


def check_frequency(prune, model, hist, log):
    assert hist[0] == hist[1] and hist[1] != hist[2] and hist[2] == hist[3] and hist[3] != hist[4]


def check_decay(prune, model, hist, log):
    cube, exp = get_scheduler(0, 4, 0.5, "cube"), get_scheduler(0, 4, 0.5, "exp")
    assert abs(cube.sparsity(2) - exp.sparsity(2)) > 0.1
    assert prune.totals[2] == pytest.approx(cube.sparsity(2), abs=2e-3)


def check_max(prune, model, hist, log):
    assert max(hist[-1].values()) <= 0.6 + 1e-9 and total_sparsity(model) == pytest.approx(0.55, abs=2e-3)


def check_min(prune, model, hist, log):
    assert min(hist[-1].values()) >= 0.4 - 1e-9 and total_sparsity(model) == pytest.approx(0.5, abs=2e-3)


def check_names(prune, model, hist, log):
    assert masked_layers(model) == ["fc1"]


def check_excluded(prune, model, hist, log):
    # 2.x also leaves the final classifier alone
    assert masked_layers(model) == (["conv1", "conv2", "head"] if prune._config.layout == "1.x" else ["conv1", "conv2"])


def check_types(prune, model, hist, log):
    assert masked_layers(model) == (["fc1", "fc2", "head"] if prune._config.layout == "1.x" else ["fc1", "fc2"])


def check_conv_types(prune, model, hist, log):
    assert masked_layers(model) == ["conv1", "conv2"]


def warns(key):
    def check(prune, model, hist, log):
        assert key in log, log
        assert total_sparsity(model) == pytest.approx(0.5, abs=1e-3)  # and nothing else changed
    return check


def check_params(prune, model, hist, log):
    assert total_sparsity(model) == pytest.approx(0.25, abs=2e-3)


def check_head_kept(prune, model, hist, log):
    assert "head" not in masked_layers(model)


# (layout, key, settings merged into the base config, steps, check)
EFFECT = [
    ("1.x", "prune_type", {"prune_type": "snip", "end_step": 1}, 2, check_prune_type),
    ("1.x", "pattern", {"pattern": "tile_pattern_1x4", "names": ["fc"]}, 1, check_pattern_nxm),
    ("1.x", "pattern", {"pattern": "tile_pattern_1:4", "target_sparsity": 0.25, "names": ["fc", "conv2"]}, 1, check_pattern_nm),
    ("1.x", "target_sparsity", {"target_sparsity": 0.25}, 1, check_target),
    ("1.x", "prune_domain", {"prune_domain": "local"}, 1, check_local),
    ("1.x", "start_step", {"start_step": 2, "end_step": 2}, 3, check_start_step),
    ("1.x", "end_step", {"end_step": 3}, 4, check_end_step),
    ("1.x", "update_frequency_on_step", {"end_step": 4, "update_frequency_on_step": 2}, 5, check_frequency),
    ("1.x", "sparsity_decay_type", {"end_step": 4, "sparsity_decay_type": "cube"}, 3, check_decay),
    ("1.x", "max_sparsity_ratio_per_layer", {"target_sparsity": 0.55, "max_sparsity_ratio_per_layer": 0.6}, 1, check_max),
    ("1.x", "names", {"names": ["fc1"]}, 1, check_names),
    ("1.x", "excluded_names", {"excluded_names": ["fc"]}, 1, check_excluded),
    ("1.x", "extra_excluded_names", {"extra_excluded_names": ["fc"]}, 1, check_excluded),
    ("1.x", "prune_layer_type", {"prune_layer_type": ["Linear"]}, 1, check_types),
    ("1.x", "initial_sparsity", {"initial_sparsity": 0.3}, 1, warns("initial_sparsity=0.3 has no effect")),
    ("1.x", "start_epoch", {"start_epoch": 1}, 1, warns("start_epoch=1 is ignored")),
    ("1.x", "end_epoch", {"end_epoch": 4}, 1, warns("end_epoch=4 is ignored")),
    ("1.x", "update_frequency", {"update_frequency": 2}, 1, warns("update_frequency=2 is ignored")),
    ("1.x", "method", {"method": "per_channel"}, 1, warns("method='per_channel' is ignored")),
    ("1.x", "parameters", {"parameters": {"alpha": 1}}, 1, warns("parameters={'alpha': 1} is ignored")),
    ("2.x", "pruning_type", {"pruning_type": "snip", "end_step": 1}, 2, check_prune_type),
    ("2.x", "pruning_type", {"pruning_type": "snip_progressive", "end_step": 1}, 2, check_prune_type),
    ("2.x", "pattern", {"pattern": "1x4", "op_names": ["fc"]}, 1, check_pattern_nxm),
    ("2.x", "pattern", {"pattern": "1:4", "target_sparsity": 0.25, "op_names": ["fc", "conv2"]}, 1, check_pattern_nm),
    ("2.x", "target_sparsity", {"target_sparsity": 0.25, "op_names": ["conv", "fc"]}, 1, check_target),
    ("2.x", "pruning_scope", {"pruning_scope": "local"}, 1, check_local),
    ("2.x", "start_step", {"start_step": 2, "end_step": 2}, 3, check_start_step),
    ("2.x", "end_step", {"end_step": 3}, 4, check_end_step),
    ("2.x", "pruning_frequency", {"end_step": 4, "pruning_frequency": 2}, 5, check_frequency),
    ("2.x", "sparsity_decay_type", {"end_step": 4, "sparsity_decay_type": "cube"}, 3, check_decay),
    ("2.x", "max_sparsity_ratio_per_op", {"target_sparsity": 0.55, "max_sparsity_ratio_per_op": 0.6}, 1, check_max),
    ("2.x", "min_sparsity_ratio_per_op", {"min_sparsity_ratio_per_op": 0.4}, 1, check_min),
    ("2.x", "op_names", {"op_names": ["fc1"]}, 1, check_names),
    ("2.x", "excluded_op_names", {"excluded_op_names": ["fc"]}, 1, check_excluded),
    ("2.x", "pruning_op_types", {"pruning_op_types": ["Linear"]}, 1, check_types),
    ("2.x", "pruning_op_types", {"pruning_op_types": ["Conv"]}, 1, check_conv_types),
    ("2.x", "low_memory_usage", {"low_memory_usage": True}, 1, warns("low_memory_usage=True has no effect")),
    ("2.x", "criterion_type", {"criterion_type": "snip"}, 1, warns("criterion_type='snip' is ignored")),
    ("2.x", "criterion_reduce_type", {"criterion_reduce_type": "mean", "pattern": "4x1"}, 1, check_global),
    ("2.x", "resume_from_pruned_checkpoint", {"resume_from_pruned_checkpoint": True}, 1,
     warns("resume_from_pruned_checkpoint=True has no effect")),
    ("2.x", "reg_type", {"reg_type": None}, 1, check_global),
    ("2.x", "reg_coeff", {"reg_coeff": 0.5}, 1, check_global),
    ("2.x", "backend", {"backend": "itrex"}, 1, warns("backend='itrex' has no effect")),
    ("2.x", "parameters", {"parameters": {"target_sparsity": 0.25}}, 1, check_params),
    ("2.x", "(final classifier)", {}, 1, check_head_kept),
]


@pytest.mark.parametrize("layout,key,settings,steps,check", EFFECT, ids=[f"{e[0]}-{e[1]}" for e in EFFECT])
def test_each_documented_key_takes_effect(layout, key, settings, steps, check, caplog):
    config = dict(V1 if layout == "1.x" else V2)
    config.update(settings)
    caplog.set_level(logging.WARNING, logger="prunekit")
    prune, model, hist = run(config, steps, layout)
    check(prune, model, hist, caplog.text)


def test_every_documented_key_has_an_effect_test_and_a_wrong_value_test():
    tested = {(lay, key) for lay, key, *_ in EFFECT}
    for key in list(nc.V1_KEYS) + list(nc.V1_UNUSED):
        assert ("1.x", key) in tested, key
        assert ("1.x", key) in {(lay, k) for lay, k, *_ in WRONG}, key
    for key in list(nc.V2_KEYS) + list(nc.V2_OTHER):
        assert ("2.x", key) in tested, key
        assert ("2.x", key) in {(lay, k) for lay, k, *_ in WRONG}, key


# (layout, key as written, value, error type, words of the message)
WRONG = [
    ("1.x", "prune_type", "magnitde", ValueError, ["prune_type='magnitde'", "Did you mean 'magnitude'"]),
    ("1.x", "pattern", "tile_pattern_3y3", ValueError, ["pattern='tile_pattern_3y3'", "'4x1'"]),
    ("1.x", "pattern", "tile_pattern_4:4", ValueError, ["pattern='tile_pattern_4:4'", "0 < N < M"]),
    ("1.x", "target_sparsity", 1.5, ValueError, ["target_sparsity=1.5", "below 1"]),
    ("1.x", "prune_domain", "everywhere", ValueError, ["prune_domain='everywhere'", "'global'"]),
    ("1.x", "start_step", -1, ValueError, ["start_step=-1", ">= 0"]),
    ("1.x", "end_step", "ten", TypeError, ["end_step='ten'", "integer"]),
    ("1.x", "update_frequency_on_step", 0, ValueError, ["update_frequency_on_step=0", ">= 1"]),
    ("1.x", "sparsity_decay_type", "cubic", ValueError, ["sparsity_decay_type='cubic'", "Did you mean 'cube'"]),
    ("1.x", "max_sparsity_ratio_per_layer", 0.3, ValueError, ["max_sparsity_ratio_per_layer=0.3", "target_sparsity=0.5"]),
    ("1.x", "names", "[", ValueError, ["names", "'['", "regular expression"]),
    ("1.x", "excluded_names", 5, TypeError, ["excluded_names=5", "list of strings"]),
    ("1.x", "extra_excluded_names", ["("], ValueError, ["extra_excluded_names", "'('"]),
    ("1.x", "prune_layer_type", [], ValueError, ["prune_layer_type=[]", "selects no layer"]),
    ("1.x", "initial_sparsity", 1.0, ValueError, ["initial_sparsity=1.0", "[0, 1)"]),
    ("1.x", "initial_sparsity", 0.7, ValueError, ["initial_sparsity=0.7", "above target_sparsity=0.5"]),
    ("1.x", "start_epoch", -2, ValueError, ["start_epoch=-2"]),
    ("1.x", "end_epoch", "x", ValueError, ["end_epoch='x'"]),
    ("1.x", "update_frequency", 0, ValueError, ["update_frequency=0", "> 0"]),
    ("1.x", "method", "per_row", ValueError, ["method='per_row'", "'per_tensor'"]),
    ("1.x", "parameters", [1], TypeError, ["parameters=[1]", "mapping"]),
    ("1.x", "pruning_type", "magnitude", ValueError, ["unknown key 'pruning_type'", "1.x", "'prune_type'"]),
    ("2.x", "pruning_type", "sparse_gpt", ValueError, ["pruning_type='sparse_gpt'", "prunekit.oneshot"]),
    ("2.x", "pruning_type", "lottery", ValueError, ["pruning_type='lottery'", "registered pruner"]),
    ("2.x", "pattern", "mha", ValueError, ["pattern='mha'", "attention-head"]),
    ("2.x", "pattern", "4x", ValueError, ["pattern='4x' is not a pattern"]),
    ("2.x", "target_sparsity", -0.1, ValueError, ["target_sparsity=-0.1", "[0, 1]"]),
    ("2.x", "target_sparsity", 0.3, ValueError, ["target_sparsity=0.3", "pattern='2:4'", "write target_sparsity: 0.5"]),
    ("2.x", "op_names", [3], TypeError, ["op_names=[3]", "list of strings"]),
    ("2.x", "excluded_op_names", ["*"], ValueError, ["excluded_op_names", "'*'"]),
    ("2.x", "start_step", 2.5, TypeError, ["start_step=2.5"]),
    ("2.x", "end_step", -3, ValueError, ["end_step=-3"]),
    ("2.x", "pruning_scope", "both", ValueError, ["pruning_scope='both'"]),
    ("2.x", "pruning_frequency", 0, ValueError, ["pruning_frequency=0", ">= 1"]),
    ("2.x", "min_sparsity_ratio_per_op", 0.7, ValueError, ["min_sparsity_ratio_per_op=0.7", "target_sparsity=0.5"]),
    ("2.x", "max_sparsity_ratio_per_op", 2, ValueError, ["max_sparsity_ratio_per_op=2", "[0, 1]"]),
    ("2.x", "sparsity_decay_type", "step", ValueError, ["sparsity_decay_type='step'"]),
    ("2.x", "pruning_op_types", "Linear", None, []),  # a single string is a one-element list, as in YAML
    ("2.x", "pruning_op_types", [None], TypeError, ["pruning_op_types=[None]"]),
    ("2.x", "low_memory_usage", "yes", TypeError, ["low_memory_usage='yes'", "True or False"]),
    ("2.x", "criterion_type", 3, TypeError, ["criterion_type=3"]),
    ("2.x", "criterion_reduce_type", "max", ValueError, ["criterion_reduce_type='max'", "mean"]),
    ("2.x", "criterion_reduce_type", "median", ValueError, ["criterion_reduce_type='median'"]),
    ("2.x", "resume_from_pruned_checkpoint", 3, TypeError, ["resume_from_pruned_checkpoint=3"]),
    ("2.x", "reg_type", "group_lasso", ValueError, ["reg_type='group_lasso'", "not supported"]),
    ("2.x", "reg_coeff", -1, ValueError, ["reg_coeff=-1", ">= 0"]),
    ("2.x", "backend", 3, TypeError, ["backend=3"]),
    ("2.x", "parameters", {"reg_cof": 1}, ValueError, ["parameters", "'reg_cof'", "Did you mean 'reg_coeff'"]),
    ("2.x", "prune_domain", "local", ValueError, ["unknown key 'prune_domain'", "2.x", "'pruning_scope'"]),
]


@pytest.mark.parametrize("layout,key,value,exc,words", WRONG, ids=[f"{w[0]}-{w[1]}-{w[2]!r}" for w in WRONG])
@pytest.mark.parametrize("where", ["global", "entry"])
def test_a_wrong_value_of_each_key_is_an_error_naming_it(layout, key, value, exc, words, where):
    base = dict(V1 if layout == "1.x" else V2)
    if key == "target_sparsity" and value == 0.3:
        base["pattern"] = "2:4"
    if key in ("max_sparsity_ratio_per_layer", "max_sparsity_ratio_per_op", "min_sparsity_ratio_per_op"):
        base["target_sparsity"] = 0.5
    entries = "pruners" if layout == "1.x" else "pruning_configs"
    if where == "global":
        base[key] = value
        base[entries] = [{}]
    else:
        base[entries] = [{key: value}]
    model = Small()
    if exc is None:
        prune = Pruning(nc.load_config(base, layout))
        prune.model = model
        prune.on_train_begin()
        return
    with pytest.raises(exc) as info:
        prune = Pruning(nc.load_config(base, layout))
        prune.model = model
        prune.on_train_begin()
    msg = str(info.value)
    for w in words:
        assert w in msg, (w, msg)
    if where == "entry" and "unknown key" not in msg:
        assert "pruners[0]" in msg
    assert not prunekit.is_pruned(model)


def test_yaml_v2_section_with_prunerv2_tags(tmp_path):
    (tmp_path / "v2.yaml").write_text(textwrap.dedent("""
        version: 2.0
        model: {name: bert, framework: pytorch}
        pruning:
          approach:
            weight_compression_v2:
              target_sparsity: 0.5
              pruning_type: magnitude
              pattern: 1x1
              pruners:
                - !PrunerV2
                    op_names: ['fc1']
                - !PrunerV2
                    op_names: ['conv']
                    pattern: tile_pattern_1:4
                    target_sparsity: 0.25
    """))
    prune = Pruning(str(tmp_path / "v2.yaml"))
    assert prune._config.layout == "2.x"
    prune.model = Small()
    prune.on_train_begin()
    assert [p.config.pattern for p in prune.pruners] == ["1x1", "3:4"]
    assert [sorted(p.modules) for p in prune.pruners] == [["fc1"], ["conv1", "conv2"]]


def test_config_files_that_are_not_neural_compressor_configs(tmp_path):
    (tmp_path / "legacy.yaml").write_text("pruning: {approach: {weight_compression: {initial_sparsity: 0.0}}}")
    with pytest.raises(ValueError, match="weight_compression is not a section prunekit reads .*epoch-based legacy"):
        Pruning(str(tmp_path / "legacy.yaml"))
    (tmp_path / "bad.yaml").write_text("pruning: {approach: {weight_compression_pytorch: {pruners: [!Pruner 3]}}}")
    with pytest.raises(ValueError, match=r"bad.yaml: not valid YAML \(!Pruner needs a mapping of keys, line 1 column 61\)"):
        Pruning(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="mixes Neural Compressor 1.x keys .*'prune_type'.* and 2.x keys .*'op_names'"):
        nc.load_config({"prune_type": "magnitude", "op_names": ["fc"]})
    with pytest.raises(ValueError, match="config file not found"):
        Pruning(str(tmp_path / "missing.yaml"))


def test_update_items_for_all_pruners_and_call_order_errors():
    prune = Pruning({"prune_type": "magnitude", "pattern": "tile_pattern_1x1", "target_sparsity": 0.5,
                     "pruners": [{"names": ["fc1"]}, {"names": ["conv1"]}]})
    prune.update_items_for_all_pruners(target_sparsity=0.25)
    assert [e["target_sparsity"] for e in prune.pruners_info] == [0.25, 0.25]
    with pytest.raises(ValueError, match="cannot update unknown key 'target_sparsty'.*Did you mean 'target_sparsity'"):
        prune.update_config(target_sparsty=0.3)
    with pytest.raises(ValueError, match="target_sparsity=1.5"):
        prune.update_config(target_sparsity=1.5)
    assert [e["target_sparsity"] for e in prune.pruners_info] == [0.25, 0.25]  # a refused update changes nothing
    with pytest.raises(ValueError, match="call on_train_begin\\(\\) first"):
        prune.on_step_begin(0)
    with pytest.raises(ValueError, match="set prune.model"):
        prune.on_train_begin()
    prune.model = Small()
    prune.prepare()
    prune.on_train_begin()
    prune.on_step_begin(0)
    prune.on_step_end()
    assert [round(p._group_sparsity(), 2) for p in prune.pruners] == [0.25, 0.25]
    with pytest.raises(ValueError, match="before on_train_begin"):
        prune.update_items_for_all_pruners(end_step=3)
    assert math.isclose(prune.get_sparsity_ratio()[0], (128 + 72) / sum(
        m.weight.numel() for m in prune.model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))))


# ------------------------------------------------------------------ the YAML goes through prunekit's hostile reader
def _no_hang(fn, *args):
    """fn(*args) in a thread: (value, error), or the test fails (instead of hanging) if it blocks."""
    import threading

    box = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), f"{fn.__name__}{args} did not return"
    return box.get("value"), box.get("error")


def _laughs(levels=8):
    items = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, cur in zip("abcdefgh", "bcdefghi"[:levels - 1]):
        items.append(f"&{cur} [" + ", ".join(["*" + prev] * 9) + "]")
    return "pruning_type: magnitude\npruning_configs:\n  - op_names: [" + ", ".join(items) + "]\n"


def test_hostile_yaml_is_refused_cleanly_and_at_once(tmp_path):
    from prunekit.io import UnreadableFileError

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    cases = {
        "fifo.yaml": (None, "not a regular file (a FIFO (named pipe)); give a Neural Compressor config"),
        "laughs.yaml": (_laughs(), "expands to more than 100000 values through aliases"),
        "binary.yaml": (b"pruning_type: magnitude\n\x89PNG\r\n\x1a\n\xff\xfe", "not UTF-8 text (byte 24)"),
        "deep.yaml": ("pruning_configs: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML"),
        "deep2.yaml": ("pruning_configs: " + "[" * 100 + "]" * 100 + "\n", "nested deeper than 64 levels"),
        "self.yaml": ("pruning_configs: &a [*a]\n", "an alias refers to a value that contains it (line 1)"),
        "dup.yaml": ("pruning_type: magnitude\npruning_type: snip_momentum\n",
                     "not valid YAML (duplicate key 'pruning_type', line 2); keep one"),
        "number.yaml": ("target_sparsity: 1" + ":1" * 5000 + "\n", "a number 10001 characters long (line 1)"),
        "big.yaml": ("pruning_configs:\n" + "  - op_names: [fc]\n" * 60_000, "larger than 1048576 bytes"),
        "python.yaml": ("pruning_type: !!python/object/apply:os.system [echo hi]\n",
                        "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply"),
        "nul.yaml": ("pruning_type: magnitude\x00\n", "unacceptable character #x0000"),
    }
    for name, (content, _) in cases.items():
        if content is not None:
            p = tmp_path / name
            p.write_bytes(content) if isinstance(content, bytes) else p.write_text(content)
    assert len(_laughs()) < 420
    for name, (_, match) in cases.items():
        path = str(tmp_path / name)
        for load in (nc.load_config, Pruning):
            value, error = _no_hang(load, path)
            assert isinstance(error, UnreadableFileError), (name, load, value, error)
            msg = str(error)
            assert msg.startswith(path + ": ") and match in msg and len(msg) < 400, (name, msg[:400])


def test_yaml_tags_anchors_and_merge_keys_still_read(tmp_path):
    (tmp_path / "ok.yaml").write_text(textwrap.dedent("""
        pruning:
          approach:
            weight_compression_pytorch:
              prune_type: magnitude
              pattern: tile_pattern_1x1
              pruners:
                - !Pruner &first {names: &n ['fc1'], target_sparsity: 0.5}
                - !Pruner {<<: *first, target_sparsity: 0.25, start_step: 1, end_step: 2}
                - !Pruner {names: *n, excluded_names: ['fc2'], target_sparsity: 0.75}
    """))
    cfg = nc.load_config(str(tmp_path / "ok.yaml")).to_pruning_config()
    assert [(p.names, p.target_sparsity, p.start_step) for p in cfg.pruners] == [
        (["fc1"], 0.5, 0), (["fc1"], 0.25, 1), (["fc1"], 0.75, 0)]
    assert cfg.pruners[2].excluded_names == ["fc2"]
