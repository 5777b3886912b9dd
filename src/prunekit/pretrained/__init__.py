"""Hugging Face model folders of pruned models: plain weights, masks beside them.

A pruned module holds ``weight_orig`` and ``weight_mask`` where a dense one
holds ``weight`` (torch's layout, kept by ``state_dict()``). A folder written
with those names is one that plain ``transformers`` cannot read: its
``from_pretrained`` finds no ``weight`` and initialises it at random. So once
prunekit has pruned a module, ``PreTrainedModel.save_pretrained`` (and so
``Trainer.save_model`` and every ``Trainer`` checkpoint) writes:

* ``model.safetensors`` (or its shards) with the *effective* weights under the
  plain names -- ``weight = weight_orig * weight_mask``, pruned entries zero --
  which plain ``from_pretrained`` loads as the pruned model, sparsity and all;
* :data:`MASKS_FILE` (``prunekit_masks.safetensors``) beside it: each mask as
  a packed bitmask, with its shape, dtype and the number of zeros of the
  weight it belongs to, so :func:`load_pretrained` / :func:`restore_masks`
  put the masks back and pruning (or training) continues where it stopped.

How: ``save_pretrained`` takes the state dict to write as its
``state_dict=`` argument; prunekit wraps ``PreTrainedModel.save_pretrained``
(once, when a module is first pruned while ``transformers`` is loaded) so that
for a model with masks it passes the effective state dict there and writes the
masks file; a model without masks is saved exactly as before (a stale masks
file from an earlier save is removed). ``module.state_dict()`` itself is not
changed. :func:`save_pretrained` is the same thing as a plain function.

What is not kept: the values ``weight_orig`` holds *under* the mask (the
entries the mask zeroes), as :func:`prunekit.remove` drops them; a restored
model has zeros there (training pruners and one-shot pruning keep zeros
there anyway). Masks with values other than 0 and 1 (scaling masks) are
stored whole, with their ``weight_orig``, and restored exactly.

The package's modules: :mod:`.masks` (the masks file, its writer's contents
and its reader), :mod:`.save` (the ``save_pretrained`` hook, :func:`load_pretrained`)
and :mod:`.dense_loads` (dense weights loaded into a pruned model).

Examples:
    >>> import tempfile, torch, transformers, prunekit
    >>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...                               intermediate_size=16, max_position_embeddings=8)
    >>> model = transformers.BertModel(cfg)
    >>> query = model.encoder.layer[0].attention.self.query
    >>> _ = prunekit.l1_unstructured(query, "weight", 32)
    >>> folder = tempfile.mkdtemp()
    >>> model.save_pretrained(folder)
    >>> plain = transformers.BertModel.from_pretrained(folder)          # plain transformers: pruned weights
    >>> torch.equal(plain.encoder.layer[0].attention.self.query.weight, query.weight)
    True
    >>> again = prunekit.load_pretrained(folder, transformers.BertModel)  # masks back
    >>> prunekit.is_pruned(again), int((again.encoder.layer[0].attention.self.query.weight_mask == 0).sum())
    (True, 32)
"""

from __future__ import annotations

from .dense_loads import accept_dense_weights, dense_weights_loaded, stop_accepting_dense_weights
from .masks import MASKS_FILE, SavedMask, apply_saved, check_weights, read_masks, restore_masks, split_state_dict
from .save import install_save_hooks, load_pretrained, save_pretrained

__all__ = [
    "MASKS_FILE",
    "SavedMask",
    "accept_dense_weights",
    "apply_saved",
    "check_weights",
    "dense_weights_loaded",
    "install_save_hooks",
    "load_pretrained",
    "read_masks",
    "restore_masks",
    "save_pretrained",
    "split_state_dict",
    "stop_accepting_dense_weights",
]
