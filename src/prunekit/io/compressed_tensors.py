"""Export to the compressed-tensors layout (what vLLM serves): one entry of the table of encodings.

``prunekit.save_compressed(model, folder, format="compressed-tensors")`` writes
a Hugging Face model folder -- ``model.safetensors`` plus ``config.json``
whose ``quantization_config`` carries the ``sparsity_config`` -- using the
`compressed-tensors <https://github.com/neuralmagic/compressed-tensors>`_
package itself for the layout, chosen tensor by tensor: its
``sparse-24-bitmask`` compressor for the ``nn.Linear`` weights that have the
2:4 pattern (at most 2 non-zeros in every 4 consecutive inputs) when any has
it, its ``sparse-bitmask`` compressor otherwise (for every linear weight,
``nn.Linear`` or GPT-2's ``Conv1D``, that a bitmask stores smaller). Every
other linear layer -- an unpruned one, a tied ``lm_head`` whose embedding has a
zero padding row, a weight without the folder's pattern -- is listed in
``ignore`` and stored dense: one such tensor never changes how the others are
stored. compressed-tensors' 2:4 layout groups each stored row, which is a
``Conv1D``'s output axis (its weight is ``(in, out)``), so a ``Conv1D`` pruned
2:4 along its inputs is stored as a bitmask, never re-grouped.

Tied tensors (a language model's ``lm_head`` and its input embedding) are
stored once, under the name ``transformers`` keeps, as ``save_pretrained``
does: ``from_pretrained`` ties them again; after compressed-tensors'
``decompress`` (which replaces each parameter it loads), call
``model.tie_weights()``.

The weights exported are the model's effective weights
(``weight_orig * weight_mask`` for pruned tensors, through
:func:`prunekit.dense_state_dict`), with pruned zeros stored as ``+0.0``
(the bitmask layout keeps no sign for zeros). :func:`read_compressed_tensors`
loads the folder back through compressed-tensors' own decompressor, bit-exact.

The folder is written beside its final place and swapped in when complete
(:func:`prunekit.io.folders.atomic_folder`): a failed or interrupted export
never leaves a half-written model and never loses the export it replaces,
and a reader finds the old export or the new one, never a missing folder.
The folder stays the plain layout ``transformers``' ``from_pretrained`` and
compressed-tensors load (``config.json`` plus ``model.safetensors``).

:func:`read_compressed_tensors` treats the folder as hostile: it reads only
the folder's own regular files (``config.json``, ``model.safetensors`` or the
shards a ``model.safetensors.index.json`` names -- plain names, no links, no
``../``), each once, through prunekit's reader, from one open handle of the
folder, and checks that none changed while it read (else it reads again), so
a re-export at the same time gives the old tensors or the new ones, never a
mix. Every compressed weight's parts are checked against each other -- the
``shape`` against the bitmask's size, the number of stored values against
the bitmask's population, ``row_offsets`` against both, the 2:4 pattern --
before compressed-tensors' own decompressor allocates anything, so a dense
weight never takes more than ``8 x`` element size bytes per stored bitmask
byte. See ``docs/trust-compressed.md``.

Needs ``pip install prunekit[compressed-tensors]``: ``compressed-tensors``
0.12-0.13 (later releases dropped the sparse compressors; 0.14 needs
``transformers<5``) and ``transformers``.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import time
from collections import OrderedDict
from typing import IO, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .errors import UnreadableFileError
from .reader import (
    open_in_folder,
    read_safetensors_header,
    read_safetensors_tensor,
)
from .folders import atomic_folder
from .hf_shards import INDEX_FILE, SINGLE_FILE, read_json_file, weight_map_of
from .layers import fits_n_m, linear_layers, tied_aliases, tied_keys_of
from .writer import _TMP_MARK, resolve_target, write_json

__all__ = ["write_compressed_tensors", "read_compressed_tensors", "sparsity_structure_of"]

logger = logging.getLogger(__name__)
_COMPRESSED_PARTS = ("shape", "compressed", "bitmask", "row_offsets")
_PARTS = {"sparse-bitmask": ("shape", "compressed", "bitmask", "row_offsets"),
          "sparse-24-bitmask": ("shape", "compressed", "bitmask")}
_SINGLE = SINGLE_FILE
_INDEX = INDEX_FILE
_read_json = read_json_file
_weight_map = weight_map_of
_READ_ATTEMPTS = 8
_MAX_DIM = 2 ** 31


def _ct() -> Any:
    try:
        import compressed_tensors  # noqa: F401
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.config import BitmaskConfig, Sparse24BitMaskConfig
    except ImportError as e:
        raise ImportError("format='compressed-tensors' needs the compressed-tensors package: "
                          "pip install 'prunekit[compressed-tensors]' (compressed-tensors>=0.12,<0.14)") from e
    return ModelCompressor, BitmaskConfig, Sparse24BitMaskConfig


def sparsity_structure_of(weights: Dict[str, torch.Tensor], in_axes: Optional[Mapping[str, int]] = None) -> str:
    """``"2:4"`` when every weight has the 2:4 pattern along its inputs, else ``"unstructured"``.

    The inputs of a weight run along axis 1 (``nn.Linear``'s ``(out, in)``) unless
    ``in_axes`` gives another (0 for ``Conv1D``'s ``(in, out)``).

    Examples:
        >>> import torch
        >>> sparsity_structure_of({"a": torch.tensor([[1.0, 0.0, 2.0, 0.0]])})
        '2:4'
        >>> sparsity_structure_of({"a": torch.tensor([[1.0, 3.0, 2.0, 0.0]])})
        'unstructured'
        >>> sparsity_structure_of({"a": torch.tensor([[1.0], [0.0], [2.0], [0.0]])}, in_axes={"a": 0})
        '2:4'
    """
    axes = in_axes or {}
    return "2:4" if weights and all(fits_n_m(w, axes.get(k, 1)) for k, w in weights.items()) else "unstructured"


def _effective_state_dict(model: Any) -> Tuple["OrderedDict[str, torch.Tensor]", "OrderedDict[str, str]"]:
    """The model's effective tensors, each tied tensor once; and the tied names left out -> the name kept."""
    from ..state_dict import dense_state_dict

    dense = dense_state_dict(model)
    aliases = tied_aliases(dense, tied_keys_of(model))
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for k, v in dense.items():
        if k in aliases:
            continue
        v = v.detach().to("cpu").contiguous()
        if v.is_floating_point():
            v = torch.where(v == 0, torch.zeros((), dtype=v.dtype), v)  # -0.0 -> +0.0: no sign in a bitmask
        out[k] = v.clone()
    return out, aliases


def _bitmask_pays(w: torch.Tensor) -> bool:
    """Whether ``sparse-bitmask`` stores ``w`` in fewer bytes than dense (values, bitmask, row offsets)."""
    rows, cols = w.shape
    nnz = int(torch.count_nonzero(w))
    return nnz * w.element_size() + rows * math.ceil(cols / 8) + rows * 8 < w.numel() * w.element_size()


def _choose(model: Any, sd: Dict[str, torch.Tensor], aliases: Dict[str, str], ignore: Sequence[str],
            structure: Optional[str]) -> Tuple[str, "OrderedDict[str, torch.Tensor]", List[str]]:
    """The folder's structure, the weights it compresses (layer name -> weight) and the linear layers left dense.

    Per tensor: with ``"2:4"``, the ``nn.Linear`` weights that have the pattern along
    their inputs (compressed-tensors' 2:4 layout groups a stored row, which is a
    ``Conv1D``'s output axis); with ``"unstructured"``, every linear weight whose
    bitmask is smaller than it. Every other linear layer stays dense.
    """
    layers = linear_layers(model)
    unknown = [n for n in ignore if n not in layers]
    if unknown:
        names = list(layers)
        raise ValueError(f"ignore={list(ignore)!r}: {unknown[0]!r} is not a Linear (or Conv1D) module of "
                         f"{type(model).__name__}; Linear modules: {names[:8]}{' ...' if len(names) > 8 else ''}")
    sparse = OrderedDict((n, sd[n + ".weight"]) for n in layers
                         if n not in ignore and n + ".weight" not in aliases and n + ".weight" in sd
                         and bool((sd[n + ".weight"] == 0).any()))
    if not sparse:
        raise ValueError(f"{type(model).__name__} has no Linear (or Conv1D) weight with zeros to export as sparse; "
                         "prune it first (or save it with format='safetensors')")
    two_four = OrderedDict((n, w) for n, w in sparse.items() if layers[n] == 1 and fits_n_m(w, 1))
    if structure is None:
        structure = "2:4" if two_four else "unstructured"
    if structure == "2:4":
        if not two_four:
            first = next(iter(sparse))
            along = " (a Conv1D: compressed-tensors' 2:4 layout groups its outputs)" if layers[first] == 0 else ""
            raise ValueError(f"sparsity_structure='2:4': no Linear weight has the 2:4 pattern (at most 2 non-zeros "
                             f"in every 4 consecutive inputs); {first!r}{along} does not have the 2:4 pattern; "
                             "prune with pattern '2:4' or export with sparsity_structure='unstructured'")
        chosen = two_four
    else:
        chosen = OrderedDict((n, w) for n, w in sparse.items() if _bitmask_pays(w))
        if not chosen:
            raise ValueError(f"{type(model).__name__}: no Linear (or Conv1D) weight has zeros enough to store smaller "
                             "as a bitmask; prune it further (or save it with format='safetensors')")
    dense = [n for n in layers if n not in chosen]
    left = [n for n in sparse if n not in chosen]
    if left:
        logger.info("save_compressed(format='compressed-tensors'): %d weight(s) with zeros stored dense in the %s "
                    "layout (%s%s)", len(left), structure, ", ".join(left[:4]), " ..." if len(left) > 4 else "")
    return structure, chosen, dense


def write_compressed_tensors(model: Any, path: Any, *, sparsity_structure: Optional[str] = None,
                             ignore: Sequence[str] = (), config: Any = None) -> Dict[str, Any]:
    """Write ``model`` as a Hugging Face folder in the compressed-tensors sparse layout; returns the sparsity config.

    Args:
        model: a (pruned) ``torch.nn.Module``, usually a ``transformers`` model; its
            ``config`` is written as ``config.json`` (or pass ``config``).
        path: the folder to write (replaced, complete, if it exists).
        sparsity_structure: ``"2:4"`` (compressed-tensors' ``sparse-24-bitmask`` for
            the ``nn.Linear`` weights that have the pattern along their inputs; at
            least one must) or ``"unstructured"`` (``sparse-bitmask`` for every
            linear weight a bitmask stores smaller); by default ``"2:4"`` when any
            ``nn.Linear`` weight has the pattern. Every other linear layer is stored
            dense (and listed in ``ignore``).
        ignore: names of linear modules (``nn.Linear``, ``Conv1D``) to leave dense.
        config: a ``transformers`` config or a dict, when ``model`` has no ``config``.

    Examples:
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
    target = resolve_target(os.fspath(path))
    if os.path.lexists(target) and not os.path.isdir(target):
        raise FileExistsError(errno.EEXIST, "is a file; format='compressed-tensors' writes a model folder: give a "
                              "folder name", os.fspath(path))
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
    sd, aliases = _effective_state_dict(model)
    untied = [k for k in tied_keys_of(model) if k in sd]  # pruned apart from its source: no longer tied
    if untied and cfg_dict.get("tie_word_embeddings"):
        cfg_dict["tie_word_embeddings"] = False  # else from_pretrained would tie the pruned head back
        logger.warning("save_compressed(format='compressed-tensors'): %s no longer equals the weight it is tied "
                       "to (it was pruned on its own); config.json says tie_word_embeddings=false", untied[0])
    structure, chosen, dense = _choose(model, sd, aliases, ignore, sparsity_structure)
    zeros = sum(int((w == 0).sum()) for w in chosen.values())
    total = sum(w.numel() for w in chosen.values())
    axes = linear_layers(model)
    targets = [cls for cls, axis in (("Linear", 1), ("Conv1D", 0)) if any(axes[n] == axis for n in chosen)]
    conf_cls = Sparse24BitMaskConfig if structure == "2:4" else BitmaskConfig
    sparsity_config = conf_cls(global_sparsity=zeros / total, sparsity_structure=structure, targets=targets,
                               ignore=dense)
    compressor = ModelCompressor(sparsity_config=sparsity_config)
    compressed = compressor.compress(model, state_dict=sd)
    from safetensors.torch import save_file

    with atomic_folder(path) as tmp:
        write_json(os.path.join(tmp, "config.json"), cfg_dict)
        compressor.update_config(tmp)  # compressed-tensors adds its quantization_config / sparsity_config
        save_file({k: v.contiguous() for k, v in compressed.items()}, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
    out = sparsity_config.model_dump()
    logger.info("save_compressed(format='compressed-tensors'): wrote %s (%s, %d sparse weights, %.1f%% zeros%s)",
                os.fspath(path), out["format"], len(chosen), 100 * zeros / total,
                f"; tied, stored once: {dict(aliases)}" if aliases else "")
    return out


# ----------------------------------------------------------------------------- reading (hostile input)
class _Changed(Exception):
    """The folder changed (was replaced or rewritten) while it was being read."""


def _file_id(st: os.stat_result) -> Tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _dir_id(st: os.stat_result) -> Tuple[int, int]:
    return st.st_dev, st.st_ino


def _replace_in_progress(folder: str) -> bool:
    """Whether a prunekit writer's temporary folder sits beside ``folder`` (a replace by two renames)."""
    parent, base = os.path.split(os.path.abspath(folder))
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return False
    return any(n.startswith(f".{base}.") and n.endswith(_TMP_MARK) for n in names)


def _moved(folder: str, dir_fd: Optional[int], opened_id: Optional[Tuple[int, int]]) -> bool:
    """Whether ``folder`` now names another folder than the one being read (or nothing)."""
    try:
        now = _dir_id(os.stat(folder))
    except OSError:
        return True
    if dir_fd is not None:
        return now != _dir_id(os.fstat(dir_fd))
    return opened_id is not None and now != opened_id


def _open_folder(folder: str) -> Tuple[Optional[int], Tuple[int, int]]:
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        if _replace_in_progress(folder):
            raise _Changed() from None
        raise FileNotFoundError(errno.ENOENT, "no compressed-tensors model folder", folder) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnreadableFileError(f"{folder}: not a folder; give a Hugging Face model folder")
    if os.open not in os.supports_dir_fd or not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows
        return None, _dir_id(st)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _Changed() from None
    return fd, _dir_id(os.fstat(fd))


def _snapshot(folder: str) -> Tuple[Dict[str, Any], "OrderedDict[str, torch.Tensor]"]:
    """config.json and every stored tensor, all from one folder, none changed while read (else ``_Changed``)."""
    dir_fd, folder_id = _open_folder(folder)
    opened: List[Tuple[str, IO[bytes], Tuple[int, ...]]] = []

    def take(name: Any, what: str) -> IO[bytes]:
        try:
            f = open_in_folder(folder, name, dir_fd=dir_fd, what=what)
        except FileNotFoundError:
            if _moved(folder, dir_fd, folder_id):  # replaced (and the old one removed) while being read
                raise _Changed() from None
            raise
        opened.append((name, f, _file_id(os.fstat(f.fileno()))))
        return f

    try:
        names = set(os.listdir(dir_fd if dir_fd is not None else folder))
        if "config.json" not in names:
            if _moved(folder, dir_fd, folder_id):
                raise _Changed()
            raise UnreadableFileError(f"{folder}: no config.json; not a Hugging Face model folder")
        cfg = _read_json(take("config.json", "config.json"), os.path.join(folder, "config.json"))
        if not isinstance(cfg, dict):
            raise UnreadableFileError(f"{os.path.join(folder, 'config.json')}: a JSON {type(cfg).__name__}, "
                                      "not an object")
        weight_map: Optional[Dict[str, str]] = None
        if _SINGLE in names:  # what transformers and compressed-tensors load first
            files = [_SINGLE]
        elif _INDEX in names:
            where = os.path.join(folder, _INDEX)
            weight_map = _weight_map(_read_json(take(_INDEX, "index file"), where), where)
            files = sorted(set(weight_map.values()))
        else:
            raise UnreadableFileError(f"{folder}: no {_SINGLE} and no {_INDEX}; expected a Hugging Face model "
                                      "folder with safetensors weights")
        handles = [take(name, "safetensors file") for name in files]  # every name checked before a byte is read
        plain: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for name, f in zip(files, handles):
            p = os.path.join(folder, name)
            header = read_safetensors_header(f, p)
            for k in header.tensors:
                if weight_map is not None and weight_map.get(k) != name:
                    raise UnreadableFileError(f"{p}: holds tensor {k!r}, which {_INDEX} "
                                              + (f"puts in {weight_map[k]!r}" if k in weight_map else "does not list"))
                plain[k] = read_safetensors_tensor(f, header, k)
        if weight_map is not None:
            missing = [k for k in weight_map if k not in plain]
            if missing:
                raise UnreadableFileError(f"{os.path.join(folder, weight_map[missing[0]])}: has no tensor "
                                          f"{missing[0]!r}, which {_INDEX} puts there")
        for name, f, seen in opened:  # nothing was rewritten, renamed or replaced while it was read
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if dir_fd is not None else \
                os.stat(os.path.join(folder, name), follow_symlinks=False)
            if _file_id(os.fstat(f.fileno())) != seen or _file_id(now) != seen:
                raise _Changed()
        return cfg, plain
    except FileNotFoundError:
        if _moved(folder, dir_fd, folder_id):
            raise _Changed() from None
        raise
    finally:
        for _, f, _ in opened:
            f.close()
        if dir_fd is not None:
            os.close(dir_fd)


def _int_list(t: torch.Tensor, where: str, what: str) -> List[int]:
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise UnreadableFileError(f"{where}: {what} is {t.dtype}; it must hold integers")
    return [int(v) for v in t.reshape(-1).tolist()]


def _check_layer(fmt: str, prefix: str, parts: Dict[str, torch.Tensor], plain: Dict[str, torch.Tensor],
                 where: str, conv1d: bool = False) -> List[int]:
    """Check one compressed weight's parts against each other, before anything is allocated; its dense shape.

    ``conv1d``: the folder compresses ``Conv1D`` weights (``(in, out)``), whose bias has ``out`` = columns values.
    """
    at = f"{where}: compressed weight {prefix + '.weight'!r}"
    expected = _PARTS[fmt]
    if set(parts) != set(expected):
        raise UnreadableFileError(f"{at} has the parts {sorted(parts)}; {fmt} stores exactly {sorted(expected)}")
    shape_t, bitmask, values = parts["shape"], parts["bitmask"], parts["compressed"]
    if shape_t.numel() != 2 or shape_t.dim() > 2:
        raise UnreadableFileError(f"{at}: its shape tensor holds {list(shape_t.shape)} values; a Linear weight's "
                                  "shape is 2 numbers (rows, columns)")
    rows, cols = _int_list(shape_t, at, "its shape tensor")
    if not (0 < rows < _MAX_DIM and 0 < cols < _MAX_DIM):
        raise UnreadableFileError(f"{at}: shape [{rows}, {cols}] is not a weight's shape")
    width = math.ceil(cols / 8)
    if bitmask.dtype != torch.uint8 or list(bitmask.shape) != [rows, width]:
        raise UnreadableFileError(f"{at}: shape [{rows}, {cols}] needs a uint8 bitmask of [{rows}, {width}], the "
                                  f"file stores {bitmask.dtype} {list(bitmask.shape)} (a lying shape, or a damaged "
                                  "file)")
    bits = (bitmask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)).bitwise_and_(1).reshape(rows, width * 8)
    if bool(bits[:, cols:].any()):
        raise UnreadableFileError(f"{at}: the bitmask marks columns past {cols}, the width its shape gives")
    counts = bits[:, :cols].sum(dim=1, dtype=torch.int64)
    nnz = int(counts.sum())
    if not (values.is_floating_point() and values.element_size() <= 8):
        raise UnreadableFileError(f"{at}: its values are {values.dtype}; a sparse weight stores floating values")
    if fmt == "sparse-bitmask":
        if values.dim() != 1 or values.numel() != nnz:
            raise UnreadableFileError(f"{at}: the bitmask marks {nnz} non-zeros, the file stores "
                                      f"{list(values.shape)} values")
        offsets = parts["row_offsets"]
        if list(offsets.shape) != [rows] or _int_list(offsets, at, "row_offsets") != \
                (torch.cumsum(counts, 0) - counts).tolist():
            raise UnreadableFileError(f"{at}: row_offsets do not match the bitmask's rows")
    else:
        if cols % 4 or not bool((bits[:, :cols].reshape(rows, cols // 4, 4).sum(dim=-1) == 2).all()):
            raise UnreadableFileError(f"{at}: the bitmask does not keep 2 of every 4 values, as {fmt} does")
        if list(values.shape) != [rows, cols // 2]:
            raise UnreadableFileError(f"{at}: 2:4 values of a [{rows}, {cols}] weight are [{rows}, {cols // 2}], "
                                      f"the file stores {list(values.shape)}")
    bias = plain.get(prefix + ".bias")
    if bias is not None and list(bias.shape) != [rows] and not (conv1d and list(bias.shape) == [cols]):
        raise UnreadableFileError(f"{at}: shape [{rows}, {cols}] does not fit its bias of {list(bias.shape)}")
    return [rows, cols]


def _sparse_format(cfg: Dict[str, Any], where: str) -> Optional[str]:
    """The sparse format config.json declares (None: no compression), refusing what prunekit cannot read."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnreadableFileError(f"{where}: quantization_config is a {type(qc).__name__}, not an object")
    if qc.get("quant_method", "compressed-tensors") != "compressed-tensors":
        raise UnreadableFileError(f"{where}: quant_method {qc.get('quant_method')!r}; prunekit reads compressed-tensors "
                                  "folders only")
    if qc.get("config_groups"):
        raise UnreadableFileError(f"{where}: the folder is quantized; prunekit reads compressed-tensors' sparse "
                                  "layouts only (load it with compressed-tensors or vLLM)")
    sc = qc.get("sparsity_config")
    if sc is None:
        return None
    fmt = sc.get("format") if isinstance(sc, dict) else None
    if fmt == "dense":
        return None
    if fmt not in _PARTS:
        raise UnreadableFileError(f"{where}: sparsity format {fmt!r}; prunekit reads {sorted(_PARTS)}")
    return fmt


def read_compressed_tensors(path: Any, **_options: Any) -> "OrderedDict[str, torch.Tensor]":
    """Read a compressed-tensors model folder back as a dense state dict, through compressed-tensors' decompressor.

    The folder is hostile input: only its own regular files are read
    (``config.json``, then ``model.safetensors`` or the shards its
    ``model.safetensors.index.json`` names), each once through prunekit's
    reader, and all from one folder: if it is replaced or rewritten meanwhile,
    it is read again (a few times, then refused), so the tensors are those of
    one export, never a mix. Each compressed weight's parts are checked against
    each other before compressed-tensors decompresses it. Every refusal is an
    :class:`UnreadableFileError` (a ``ValueError``) naming the file and why.

    Examples:
        >>> import os, tempfile
        >>> try:
        ...     read_compressed_tensors(tempfile.mkdtemp())
        ... except UnreadableFileError as e:
        ...     print("config.json" in str(e))
        True
    """
    ModelCompressor, _, _ = _ct()
    folder = os.fspath(path)
    for attempt in range(_READ_ATTEMPTS):
        try:
            cfg, plain = _snapshot(folder)
            break
        except _Changed:
            # a swap is over at once: read again now; a replace by two renames takes a moment
            logger.debug("read_compressed_tensors: %s changed while being read; reading it again", folder)
            time.sleep(min(0.05 * attempt, 0.2))
    else:
        raise UnreadableFileError(f"{folder}: changed while being read, {_READ_ATTEMPTS} times in a row (is it "
                                  "being written?); read it again once its writer is done")
    cfg_where = os.path.join(folder, "config.json")
    fmt = _sparse_format(cfg, cfg_where)
    if fmt is None:
        packed = [k for k in plain if k.endswith(".bitmask") and k[:-len("bitmask")] + "compressed" in plain]
        if packed:
            raise UnreadableFileError(f"{cfg_where}: the folder holds compressed weights ({packed[0]!r}, ...) but "
                                      "config.json declares no sparsity format (quantization_config.sparsity_config)")
        return plain
    where = folder
    parts_of = _PARTS[fmt]
    targets = cfg["quantization_config"]["sparsity_config"].get("targets")
    conv1d = isinstance(targets, list) and "Conv1D" in targets
    layers: Dict[str, Dict[str, torch.Tensor]] = {}
    for k in plain:
        prefix, _, leaf = k.rpartition(".")
        if leaf in _COMPRESSED_PARTS and prefix:
            if prefix + ".bitmask" not in plain:
                raise UnreadableFileError(f"{where}: {k!r} is a part of a compressed weight, but there is no "
                                          f"{prefix + '.bitmask'!r}")
            layers.setdefault(prefix, {})[leaf] = plain[k]
    for prefix, parts in layers.items():
        if prefix + ".weight" in plain:
            raise UnreadableFileError(f"{where}: {prefix + '.weight'!r} is stored both dense and compressed")
        _check_layer(fmt, prefix, parts, plain, where, conv1d=conv1d)
    try:
        compressor = ModelCompressor.from_compression_config(cfg["quantization_config"])
        sparse = getattr(compressor, "sparsity_compressor", None)
        if sparse is None:
            raise ValueError("no sparsity compressor")
        dense = {prefix: sparse.decompress_weight({leaf: parts[leaf] for leaf in parts_of})
                 for prefix, parts in layers.items()}
    except Exception as e:  # compressed-tensors raises many types on a malformed folder
        lines = str(e).strip().splitlines()
        raise UnreadableFileError(f"{folder}: compressed-tensors cannot decompress it "
                                  f"({type(e).__name__}: {lines[0] if lines else ''})") from None
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for k, v in plain.items():
        prefix, _, leaf = k.rpartition(".")
        if prefix in layers and leaf in _COMPRESSED_PARTS:
            wk = prefix + ".weight"
            if wk not in out:
                w = dense[prefix]
                rows, cols = _int_list(layers[prefix]["shape"], where, "shape")
                if not isinstance(w, torch.Tensor) or list(w.shape) != [rows, cols]:  # pragma: no cover
                    raise UnreadableFileError(f"{where}: compressed weight {wk!r} decompressed to the wrong shape")
                out[wk] = w
        else:
            out[k] = v
    return out
