"""The handler :mod:`prunekit._sharded` calls for DTensor shards (registered by ``prunekit.distributed``)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..kernels.select import NaNScoresError
from ..reparam import describe
from . import fsdp
from .layout import Piece, as_dtensor, is_dtensor, is_dtensor_type, piece_of, replica_piece, to_local_like, wrap
from .masks import global_l1, global_random, kind_of, method_mask

__all__ = ["ShardedHandler"]


class ShardedHandler:
    """Serves pruned DTensor parameters for the reparameterization and the pruning methods."""

    def claims_type(self, cls: type) -> bool:
        return is_dtensor_type(cls)

    # ------------------------------------------------------------------ value
    def value(self, module: nn.Module, name: str, orig: Tensor, mask: Tensor) -> Tensor:
        if is_dtensor(orig) and is_dtensor(mask):
            return orig * mask
        if is_dtensor(mask):
            # inside an FSDP2 forward/backward: orig is the all-gathered weight, whose pruned
            # entries were zeroed on the shards right before the all-gather (see prunekit.distributed.fsdp)
            if tuple(orig.shape) != tuple(mask.shape):
                raise RuntimeError(f"{describe(module, name)}: weight {list(orig.shape)} and mask "
                                   f"{list(mask.shape)} disagree")
            return orig
        raise TypeError(
            f"{describe(module, name)}: {name}_orig is a DTensor shard but {name}_mask is a full-size plain "
            "tensor (the model was pruned before fully_shard). Call prunekit.distributed.shard_masks(model) "
            "once after fully_shard: each rank then keeps only its shard of every mask"
        )

    # ------------------------------------------------------------------ methods
    def compute_mask(self, method: Any, module: nn.Module, name: str, orig: Tensor, existing: Optional[Tensor],
                     importance_scores: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        piece = piece_of(orig, describe(module, name))
        local = piece.local.detach()
        old = None if existing is None else to_local_like(existing, piece, f"{name}_mask").to(local.device)
        if importance_scores is not None:
            scores = to_local_like(importance_scores, piece, "importance_scores").to(local.device)
        elif old is not None and method.PRUNING_TYPE != "unstructured":
            scores = local * old  # structured methods rank what is left (orig * mask)
        else:
            scores = local
        mask = method_mask(method, piece, scores, old)  # 0/1 values in a tensor of its own
        if mask.dtype != dtype:
            mask = mask != 0 if dtype == torch.bool else mask.to(dtype)
        if not mask.is_contiguous():
            mask = mask.contiguous()
        return wrap(mask, piece)

    def check_plain(self, t: Tensor, module: nn.Module, name: str) -> None:
        if fsdp.is_unsharded_copy(t):
            raise ValueError(
                f"{describe(module, name)} is FSDP2's all-gathered copy of a sharded parameter (the model is between a forward "
                "and its backward, or its root keeps parameters gathered after an eval forward). Prune while "
                "FSDP2 holds the shards: between training steps, or after model.reshard()"
            )

    def installed(self, module: nn.Module, name: str) -> None:
        fsdp.wire(module, name)

    def uninstalled(self, module: nn.Module, name: str) -> None:
        fsdp.unwire(module, name)

    def restored(self, module: nn.Module) -> None:
        fsdp.resync(module)

    # ------------------------------------------------------------------ training
    def count_true(self, t: Tensor) -> int:
        """The number of true (non-zero) entries of a DTensor over all ranks (collective)."""
        return int(as_dtensor((t != 0).sum(), "count_true").full_tensor())

    def full(self, t: Tensor) -> Tensor:
        """The whole tensor on every rank (collective; reports gather one tensor at a time)."""
        return as_dtensor(t, "full").full_tensor()

    def update_pruner_masks(self, pruner: Any, step: int) -> None:
        from .training import update_masks

        update_masks(pruner, step)

    def check_pattern(self, pattern: Any, name: str, module: nn.Module, weight: Tensor) -> None:
        from .training import check_pattern

        check_pattern(pattern, name, module, weight)

    def count_pruned_units(self, pruner: Any, name: str, module: nn.Module, mask: Tensor) -> int:
        from .training import count_pruned_units

        return count_pruned_units(pruner, name, module, mask)

    # ------------------------------------------------------------------ global
    def global_masks(self, method: Any, pairs: Sequence[Tuple[nn.Module, str]], origs: Sequence[Tensor],
                     masks: Sequence[Optional[Tensor]], scores: Sequence[Optional[Tensor]]) -> List[Tensor]:
        kind = kind_of(method)
        if kind not in ("L1Unstructured", "RandomUnstructured"):
            raise TypeError(
                f"global_unstructured(): {type(method).__name__} has no sharded implementation; over DTensor "
                "shards prunekit.distributed runs L1Unstructured and RandomUnstructured. Compute your masks "
                "and apply them with prunekit.custom_from_mask"
            )
        pieces = _pieces(pairs, origs)
        old = [None if m is None else to_local_like(m, p, "mask") for m, p in zip(masks, pieces)]
        local_scores = [p.local.detach() if s is None else to_local_like(s, p, "importance_scores")
                        for s, p in zip(scores, pieces)]
        try:
            if kind == "L1Unstructured":
                keeps = global_l1(method.amount, pieces, local_scores, old)
            else:
                dtypes = [s.dtype for s in local_scores]
                keeps = global_random(method.amount, pieces, old, dtypes)
        except NaNScoresError as e:
            module, name = pairs[e.index]
            raise ValueError(f"global_unstructured(): {describe(module, name)}: {e}") from None
        except ValueError as e:
            raise type(e)(f"global_unstructured() over {len(pairs)} tensors: {e}") from None
        out = [wrap(k, p) for k, p in zip(keeps, pieces)]
        for m in out:  # ours: apply may store them without a copy
            setattr(m, "_prunekit_owned", True)  # a flag on the tensor object
        return out


def _pieces(pairs: Sequence[Tuple[nn.Module, str]], origs: Sequence[Tensor]) -> List[Piece]:
    first = next(i for i, o in enumerate(origs) if is_dtensor(o))
    ref = piece_of(origs[first], describe(*pairs[first]))
    out: List[Piece] = []
    for (module, name), o in zip(pairs, origs):
        if not is_dtensor(o):
            out.append(replica_piece(o.detach(), ref.comm))  # an unsharded tensor: the same on every rank
            continue
        p = piece_of(o, describe(module, name))
        if p.comm.group != ref.comm.group:
            raise ValueError(
                f"global_unstructured(): {describe(module, name)} is sharded over another process group than "
                f"{describe(*pairs[first])}; rank tensors of one group together"
            )
        out.append(p)
    return out


