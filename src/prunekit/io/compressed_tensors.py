"""Export to the compressed-tensors layout (what vLLM serves): one entry of the table of encodings.

``prunekit.save_compressed(model, folder, format="compressed-tensors")`` writes
a Hugging Face model folder -- ``model.safetensors`` plus ``config.json``
whose ``quantization_config`` carries the ``sparsity_config`` -- using the
`compressed-tensors <https://github.com/neuralmagic/compressed-tensors>`_
package itself for the layout: its ``sparse-24-bitmask`` compressor when every
sparse Linear weight has the 2:4 pattern (at most 2 non-zeros in every 4
consecutive input weights), its ``sparse-bitmask`` compressor otherwise.
Linear layers without sparsity are listed in ``ignore`` and stored dense.

The weights exported are the model's effective weights
(``weight_orig * weight_mask`` for pruned tensors, through
:func:`prunekit.dense_state_dict`), with pruned zeros stored as ``+0.0``
(the bitmask layout keeps no sign for zeros). :func:`read_compressed_tensors`
loads the folder back through compressed-tensors' own decompressor, bit-exact.

The folder is written beside its final place and moved there when complete,
each file fsynced, so a failed export never leaves a half-written model.

Needs ``pip install prunekit[compressed-tensors]``: ``compressed-tensors``
0.12-0.13 (later releases dropped the sparse compressors; 0.14 needs
``transformers<5``) and ``transformers``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections import OrderedDict
from typing import Any, Dict, Optional, Sequence

import torch

from .errors import UnreadableFileError
from .reader import open_regular, read_json, read_safetensors_header
from .writer import _fsync_dir, resolve_target, write_json

__all__ = ["write_compressed_tensors", "read_compressed_tensors", "sparsity_structure_of"]

logger = logging.getLogger(__name__)
_COMPRESSED_PARTS = ("shape", "compressed", "bitmask", "row_offsets")


def _ct() -> Any:
    try:
        import compressed_tensors  # noqa: F401
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.config import BitmaskConfig, Sparse24BitMaskConfig
    except ImportError as e:
        raise ImportError("format='compressed-tensors' needs the compressed-tensors package: "
                          "pip install 'prunekit[compressed-tensors]' (compressed-tensors>=0.12,<0.14)") from e
    return ModelCompressor, BitmaskConfig, Sparse24BitMaskConfig


def _is_2_4(w: torch.Tensor) -> bool:
    if w.dim() != 2 or w.shape[1] % 4:
        return False
    return bool(((w.reshape(-1, 4) != 0).sum(dim=1) <= 2).all())


def sparsity_structure_of(weights: Dict[str, torch.Tensor]) -> str:
    """``"2:4"`` when every weight has the 2:4 pattern along its inputs, else ``"unstructured"``.

    Example:
        >>> import torch
        >>> sparsity_structure_of({"a": torch.tensor([[1.0, 0.0, 2.0, 0.0]])})
        '2:4'
        >>> sparsity_structure_of({"a": torch.tensor([[1.0, 3.0, 2.0, 0.0]])})
        'unstructured'
    """
    return "2:4" if weights and all(_is_2_4(w) for w in weights.values()) else "unstructured"


def _effective_state_dict(model: Any) -> "OrderedDict[str, torch.Tensor]":
    from ..state_dict import dense_state_dict

    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for k, v in dense_state_dict(model).items():
        v = v.detach().to("cpu").contiguous()
        if v.is_floating_point():
            v = torch.where(v == 0, torch.zeros((), dtype=v.dtype), v)  # -0.0 -> +0.0: no sign in a bitmask
        out[k] = v.clone()
    return out


@contextlib.contextmanager
def _atomic_folder(path: Any) -> Any:
    """A temporary folder beside ``path`` that replaces it, complete, when the block succeeds."""
    user = os.fspath(path)
    target = resolve_target(user)
    if os.path.exists(target) and not os.path.isdir(target):
        raise FileExistsError(f"{user} is a file; format='compressed-tensors' writes a model folder: give a "
                              "folder name")
    parent, base = os.path.split(target)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the folder {parent} does not exist (for {user})")
    tmp = os.path.join(parent, f".{base}.{secrets.token_hex(4)}.prunekit-tmp")
    os.mkdir(tmp, 0o777)
    old = None
    try:
        yield tmp
        for name in os.listdir(tmp):
            fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(tmp)
        if os.path.isdir(target):
            old = os.path.join(parent, f".{base}.{secrets.token_hex(4)}.prunekit-old")
            os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            if old is not None:
                os.rename(old, target)
                old = None
            raise
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_compressed_tensors(model: Any, path: Any, *, sparsity_structure: Optional[str] = None,
                             ignore: Sequence[str] = (), config: Any = None) -> Dict[str, Any]:
    """Write ``model`` as a Hugging Face folder in the compressed-tensors sparse layout; returns the sparsity config.

    Args:
        model: a (pruned) ``torch.nn.Module``, usually a ``transformers`` model; its
            ``config`` is written as ``config.json`` (or pass ``config``).
        path: the folder to write (replaced, complete, if it exists).
        sparsity_structure: ``"2:4"`` (compressed-tensors' ``sparse-24-bitmask``:
            every sparse Linear weight must have the pattern) or ``"unstructured"``
            (``sparse-bitmask``); by default ``"2:4"`` when every sparse Linear
            weight has it.
        ignore: names of Linear modules to leave dense, besides those without zeros.
        config: a ``transformers`` config or a dict, when ``model`` has no ``config``.

    Example:
        >>> import os, tempfile, torch, prunekit
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1,
        ...                              num_attention_heads=2, intermediate_size=32))
        >>> for m in model.encoder.modules():
        ...     if isinstance(m, torch.nn.Linear):
        ...         _ = prunekit.l1_unstructured(m, "weight", amount=0.5)
        >>> folder = os.path.join(tempfile.mkdtemp(), "bert-sparse")
        >>> prunekit.save_compressed(model, folder, format="compressed-tensors")["format"]
        'sparse-bitmask'
        >>> sd = read_compressed_tensors(folder)
        >>> torch.equal(sd["encoder.layer.0.intermediate.dense.weight"],
        ...             model.encoder.layer[0].intermediate.dense.weight)
        True
    """
    ModelCompressor, BitmaskConfig, Sparse24BitMaskConfig = _ct()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"format='compressed-tensors' needs the model itself (its Linear layers and config), "
                        f"got a {type(model).__name__}; pass the nn.Module, not its state dict")
    if sparsity_structure not in (None, "2:4", "unstructured"):
        raise ValueError(f"sparsity_structure={sparsity_structure!r}: write '2:4', 'unstructured' or leave it None")
    cfg = config if config is not None else getattr(model, "config", None)
    if cfg is None:
        raise ValueError(f"format='compressed-tensors' writes config.json: {type(model).__name__} has no `config`; "
                         "pass config=... (a transformers config or a dict)")
    cfg_dict = dict(cfg) if isinstance(cfg, dict) else cfg.to_dict()
    if not cfg_dict.get("architectures"):
        from ..reparam import base_class

        cfg_dict["architectures"] = [base_class(model).__name__]
    sd = _effective_state_dict(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    unknown = [n for n in ignore if n not in linears]
    if unknown:
        raise ValueError(f"ignore={list(ignore)!r}: {unknown[0]!r} is not a Linear module of "
                         f"{type(model).__name__}; Linear modules: {linears[:8]}{' ...' if len(linears) > 8 else ''}")
    sparse = {n: sd[n + ".weight"] for n in linears
              if n not in ignore and n + ".weight" in sd and bool((sd[n + ".weight"] == 0).any())}
    if not sparse:
        raise ValueError(f"{type(model).__name__} has no Linear weight with zeros to export as sparse; prune it "
                         "first (or save it with format='safetensors')")
    structure = sparsity_structure or sparsity_structure_of(sparse)
    if structure == "2:4":
        bad = [n for n, w in sparse.items() if not _is_2_4(w)]
        if bad:
            raise ValueError(f"sparsity_structure='2:4': Linear {bad[0]!r} (and {len(bad) - 1} more) does not have "
                             "the 2:4 pattern (at most 2 non-zeros in every 4 consecutive inputs); prune with "
                             "pattern '2:4' or export with sparsity_structure='unstructured'")
    zeros = sum(int((w == 0).sum()) for w in sparse.values())
    total = sum(w.numel() for w in sparse.values())
    skipped = [n for n in linears if n not in sparse]
    conf_cls = Sparse24BitMaskConfig if structure == "2:4" else BitmaskConfig
    sparsity_config = conf_cls(global_sparsity=zeros / total, sparsity_structure=structure, targets=["Linear"],
                               ignore=skipped)
    compressor = ModelCompressor(sparsity_config=sparsity_config)
    compressed = compressor.compress(model, state_dict=sd)
    from safetensors.torch import save_file

    with _atomic_folder(path) as tmp:
        write_json(os.path.join(tmp, "config.json"), cfg_dict)
        compressor.update_config(tmp)  # compressed-tensors adds its quantization_config / sparsity_config
        save_file({k: v.contiguous() for k, v in compressed.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
    out = sparsity_config.model_dump()
    logger.info("save_compressed(format='compressed-tensors'): wrote %s (%s, %d sparse Linear, %.1f%% zeros)",
                os.fspath(path), out["format"], len(sparse), 100 * zeros / total)
    return out


def read_compressed_tensors(path: Any, **_options: Any) -> "OrderedDict[str, torch.Tensor]":
    """Read a compressed-tensors model folder back as a dense state dict, through compressed-tensors itself.

    Every ``*.safetensors`` file and ``config.json`` go through prunekit's
    hostile reader first; the decompression is compressed-tensors' own.

    Example:
        >>> import os, tempfile
        >>> try:
        ...     read_compressed_tensors(tempfile.mkdtemp())
        ... except UnreadableFileError as e:
        ...     print("config.json" in str(e))
        True
    """
    ModelCompressor, _, _ = _ct()
    folder = os.fspath(path)
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise UnreadableFileError(f"{folder}: no config.json; not a Hugging Face model folder")
    cfg = read_json(cfg_path, what="config.json")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not isinstance(cfg, dict) or not files:
        raise UnreadableFileError(f"{folder}: expected config.json (an object) and *.safetensors files")
    plain: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    from .reader import read_safetensors_tensor

    for name in files:
        p = os.path.join(folder, name)
        with open_regular(p, what="safetensors file") as f:
            header = read_safetensors_header(f, p)
            for k in header.tensors:
                plain[k] = read_safetensors_tensor(f, header, k)
    qc = cfg.get("quantization_config")
    try:
        compressor = ModelCompressor.from_compression_config(qc) if isinstance(qc, dict) else None
        sparse_compressor = getattr(compressor, "sparsity_compressor", None)
        dense = dict(sparse_compressor.decompress(folder)) if sparse_compressor is not None else {}
    except Exception as e:  # compressed-tensors raises many types on a malformed folder
        lines = str(e).strip().splitlines()
        raise UnreadableFileError(f"{folder}: compressed-tensors cannot decompress it "
                                  f"({type(e).__name__}: {lines[0] if lines else ''})") from None
    prefixes = {k.rsplit(".", 1)[0] for k in plain if k.rsplit(".", 1)[-1] in _COMPRESSED_PARTS
                and k.rsplit(".", 1)[0] + ".bitmask" in plain}
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for k, v in plain.items():
        prefix, _, leaf = k.rpartition(".")
        if prefix in prefixes and leaf in _COMPRESSED_PARTS:
            wk = prefix + ".weight"
            if wk not in out:
                if wk not in dense:
                    raise UnreadableFileError(f"{folder}: compressed weight {wk!r} was not decompressed")
                out[wk] = dense[wk]
        else:
            out[k] = dense.get(k, v)
    return out
