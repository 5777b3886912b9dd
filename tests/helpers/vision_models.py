"""The vision zoos (torchvision and timm classifiers, random weights) and the prune -> compact check run on them.

torchvision's wheels are built against one torch build: beside another (e.g. the CPU torch here, with
torchvision's CUDA wheel) its compiled ops fail to load and ``import torchvision`` then fails while it
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``, which only its compiled library
defines. The model definitions are pure Python, so :func:`prepare_torchvision` defines those two schemas
(no kernel: detection's ``nms`` stays unusable) and imports it again. Call it before importing torchvision,
timm or a ``transformers`` model (transformers imports torchvision whenever it is installed).

The vision packages are not part of the ``test`` extra (installed in the test environment, a torchvision
that cannot import would break every ``transformers`` import outside these tests). ``make test-zoo``
installs them, without their dependencies, into ``.zoo/`` and runs the matrices with it on the path.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

#: op schemas torchvision's Python code registers fake kernels for at import (its compiled library
#: defines them)
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY: List[Any] = []  # the torch.library.Library holding the schemas (kept alive)


def prepare_torchvision() -> bool:
    """Make ``import torchvision`` work when its compiled ops do not load; False when it is not installed.

    Imports it once as it is; if that fails on a missing ``torchvision::`` op, drops the half-imported
    modules, defines the missing schemas and imports it again.
    """
    if "torchvision" in sys.modules:
        return True
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
        return True
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for op, schema in _SCHEMAS.items():
        if not _defined(op):
            lib.define(schema)
    _LIBRARY.append(lib)
    import torchvision  # noqa: F401,F811
    return True


def _defined(op: str) -> bool:
    try:
        getattr(torch.ops.torchvision, op)
        return True
    except (AttributeError, RuntimeError):
        return False


# ------------------------------------------------------------------ the zoos

#: input side per torchvision model that cannot run at :data:`SIDE` (MaxViT's windows need 224,
#: Inception-v3's stem 75 or more)
TORCHVISION_SIDE = {"maxvit_t": 224, "inception_v3": 80}
SIDE = 64
NUM_CLASSES = 10

#: timm families: a small member of each, ``(family, timm model name, input side)``; sides under 64 are
#: passed as ``img_size`` (patch-embedding models), 224 is what the model requires
TIMM = [
    ("resnet", "resnet18", 64),
    ("efficientnet", "efficientnet_b0", 64),
    ("tf_efficientnet", "tf_efficientnet_b0", 64),
    ("mobilenetv3", "mobilenetv3_small_100", 64),
    ("convnext", "convnext_atto", 64),
    ("convnextv2", "convnextv2_atto", 64),
    ("vit", "vit_tiny_patch16_224", 32),
    ("deit", "deit_tiny_distilled_patch16_224", 32),
    ("cait", "cait_xxs24_224", 32),
    ("beit", "beit_base_patch16_224", 32),
    ("eva", "eva02_tiny_patch14_224", 28),
    ("xcit", "xcit_nano_12_p16_224", 32),
    ("levit", "levit_128s", 224),
    ("levit_conv", "levit_conv_128s", 224),
    ("mixer", "mixer_s16_224", 32),
    ("resmlp", "resmlp_12_224", 32),
    ("mobilevit", "mobilevit_xxs", 64),
    ("efficientformer", "efficientformer_l1", 224),
    ("swin", "swin_tiny_patch4_window7_224", 224),
    ("tiny_vit", "tiny_vit_5m_224", 224),
    ("gcvit", "gcvit_xxtiny", 224),
    ("coat", "coat_lite_tiny", 224),
    ("pvt_v2", "pvt_v2_b0", 64),
    ("edgenext", "edgenext_xx_small", 64),
    ("poolformer", "poolformer_s12", 64),
    ("poolformerv2", "poolformerv2_s12", 64),
    ("caformer", "caformer_s18", 64),
    ("inception_next", "inception_next_tiny", 64),
    ("fastvit", "fastvit_t8", 64),
    ("efficientvit", "efficientvit_b0", 64),
    ("repvit", "repvit_m0_9", 64),
    ("mobileone", "mobileone_s0", 64),
    ("repvgg", "repvgg_a0", 64),
    ("convmixer", "convmixer_768_32", 64),
    ("rexnet", "rexnet_100", 64),
    ("regnet", "regnetx_002", 64),
    ("ghostnet", "ghostnet_100", 64),
    ("ghostnetv2", "ghostnetv2_100", 64),
    ("lcnet", "lcnet_050", 64),
    ("hardcorenas", "hardcorenas_a", 64),
    ("mixnet", "mixnet_s", 64),
    ("cspnet", "cspresnet50", 64),
    ("res2net", "res2net50_14w_8s", 64),
    ("resnest", "resnest14d", 64),
    ("sknet", "skresnet18", 64),
    ("dpn", "dpn68", 64),
    ("densenet", "densenet121", 64),
    ("dla", "dla34", 64),
    ("hrnet", "hrnet_w18_small", 64),
    ("nfnet", "nf_resnet26", 64),
    ("vovnet", "ese_vovnet19b_dw", 64),
]


#: models without a single prunable group (exact compaction would change their output), and why
BLOCKED = {
    "convnextv2": "GlobalResponseNorm divides every channel by the mean over all channels of the MLP's hidden "
                  "layer, and its residual stream is normalized by LayerNorms",
    "nfnet": "every convolution standardizes its weight (ScaledStdConv2d): removing an input channel changes the "
             "statistics of the others, so each conv is an op the tracer does not prune through",
}


def cases(names: List[str]) -> List[Any]:
    """pytest parameters ``(name, expected outcome)``, with ids such as ``resnet18-exact``."""
    import pytest

    out = []
    for n in names:
        expected = "blocked" if n in BLOCKED else "exact"
        out.append(pytest.param(n, expected, id=f"{n}-{expected}"))
    return out


def check(outcome: "Outcome", expected: str) -> None:
    """Assert the zoo's promise: the expected verdict, a reason for every blocked group, a smaller model."""
    assert outcome.verdict == expected, outcome
    assert all(reason.strip() for reason in outcome.blocked), outcome.blocked
    if expected == "exact":
        assert outcome.macs_ratio < 1 and outcome.params_ratio < 1, outcome
    else:
        assert outcome.blocked and outcome.rel_error is None


#: (words a blocked group's reason holds, what the zoo table calls it), the first match wins
KINDS = [
    ("does not come from a prunable layer", "input not from a prunable layer"),
    ("part of the model's output", "model output"),
    ("register a handler", "module without a handler"),
    ("splits a channel dimension", "channel split into heads"),
    ("normalizes over these features", "LayerNorm statistics"),
    ("combines channels with a fixed tensor", "fixed per-channel tensor"),
    ("reduces across channels", "reduction across channels"),
    ("positions fixed in the model's code", "fixed channel cut"),
    ("contracts channels with fixed values", "contraction with fixed values"),
    ("mixes prunable and fixed channels", "prunable and fixed channels mixed"),
]


def kind(reason: str) -> str:
    """The short name (:data:`KINDS`) of a blocked group's reason; the reason itself when none matches."""
    return next((short for words, short in KINDS if words in reason), reason)


def record(name: str, outcome: "Outcome", record_property: Any) -> None:
    """Give the zoo table (``helpers/zoo_table.py``) the verdict, the groups kept and why, and the ratios."""
    kinds: Dict[str, int] = {}
    for why, n in outcome.blocked.items():
        kinds[kind(why)] = kinds.get(kind(why), 0) + n
    total = outcome.pruned_groups + sum(kinds.values())
    kept = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    family = name.split("-")[0]
    note = BLOCKED[family] + "; " if family in BLOCKED else ""
    record_property("outcome", outcome.verdict)
    record_property("reason", f"{note}{outcome.pruned_groups} of {total} groups pruned" + (f"; kept: {kept}" if kept else ""))
    record_property("macs_ratio", outcome.macs_ratio)
    record_property("params_ratio", outcome.params_ratio)


def torchvision_names() -> List[str]:
    """Every torchvision classification builder (``torchvision.models.list_models``), or [] without it."""
    if not prepare_torchvision():
        return []
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def timm_names() -> List[str]:
    """The timm models of :data:`TIMM` by family name, or [] without timm."""
    if importlib.util.find_spec("timm") is None or not prepare_torchvision():
        return []
    return [family for family, _, _ in TIMM]


def build_torchvision(name: str, seed: int = 0) -> Tuple[nn.Module, torch.Tensor]:
    """torchvision model ``name`` with random weights (10 classes, eval mode) and a batch of 2 images."""
    prepare_torchvision()
    import torchvision

    kwargs: Dict[str, Any] = {"num_classes": NUM_CLASSES}
    side = TORCHVISION_SIDE.get(name, SIDE)
    if name.startswith("vit_"):
        kwargs["image_size"] = 28 if name == "vit_h_14" else 32
        side = kwargs["image_size"]
    if name == "maxvit_t":
        kwargs["input_size"] = (side, side)
    if name in ("googlenet", "inception_v3"):
        kwargs.update(aux_logits=False, init_weights=False)
    torch.manual_seed(seed)
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    return model, torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(seed))


def build_timm(family: str, seed: int = 0) -> Tuple[nn.Module, torch.Tensor]:
    """A timm model of ``family`` (:data:`TIMM`) with random weights (10 classes, eval mode) and 2 images."""
    prepare_torchvision()
    import timm

    _, name, side = next(t for t in TIMM if t[0] == family)
    kwargs: Dict[str, Any] = {"num_classes": NUM_CLASSES}
    if side < 64:
        kwargs["img_size"] = side
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    return model, torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ the check


@dataclass
class Outcome:
    """What :func:`prune_and_compact` did to one model."""

    pruned_groups: int = 0
    blocked: Dict[str, int] = field(default_factory=dict)  # reason -> number of groups
    rel_error: Optional[float] = None  # compacted vs masked output
    macs_ratio: Optional[float] = None  # compacted MACs / dense MACs
    params_ratio: Optional[float] = None
    seconds: float = 0.0  # dependency graph + prune_groups + compact (its own output check included)

    @property
    def verdict(self) -> str:
        """``"exact"`` (pruned, output within :data:`RTOL`), ``"blocked"`` (no prunable group) or ``"wrong"``."""
        if not self.pruned_groups:
            return "blocked"
        return "exact" if self.rel_error is not None and self.rel_error <= RTOL else "wrong"


#: the largest relative error between the compacted and the masked model's outputs the zoos accept
RTOL = 1e-5


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def prune_and_compact(model: nn.Module, x: torch.Tensor, amount: float = 0.3) -> Outcome:
    """Mask ``amount`` of every prunable group by L2 magnitude (the classifier's outputs kept), compact
    ``model`` in place and compare its output with the masked model's."""
    from prunekit.compact import build_dependency_graph, compact, count_macs, count_params, prune_groups

    dense_macs, dense_params = count_macs(model, x), count_params(model)
    outcome = Outcome()
    t0 = time.perf_counter()
    graph = build_dependency_graph(model, x)
    for g in graph.groups:
        if g.blocked is not None:
            outcome.blocked[g.blocked] = outcome.blocked.get(g.blocked, 0) + 1
    decisions = prune_groups(model, x, amount, importance="l2", graph=graph)
    outcome.pruned_groups = sum(1 for d in decisions if d.removed)
    if not outcome.pruned_groups:
        outcome.seconds = time.perf_counter() - t0
        return outcome
    t1 = time.perf_counter()
    with torch.no_grad():
        masked = model(x)
    t2 = time.perf_counter()
    compact(model, x, graph=graph, inplace=True)
    outcome.seconds = time.perf_counter() - t2 + (t1 - t0)
    with torch.no_grad():
        outcome.rel_error = rel_error(model(x), masked)
    outcome.macs_ratio = count_macs(model, x) / dense_macs
    outcome.params_ratio = count_params(model) / dense_params
    return outcome
