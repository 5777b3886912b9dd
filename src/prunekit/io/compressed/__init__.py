"""prunekit's compressed checkpoint format ("prunekit"): one entry of the encodings table.

A pruned tensor is mostly zeros. :func:`save_compressed` stores each such
tensor as a packed bitmask (one bit per element: zero or not) plus its
non-zero values; a tensor whose non-zero elements are all exactly one (a
pruning mask) is stored as the bitmask alone; every other tensor stays dense.
Whichever encoding is smallest wins, tensor by tensor. Tied tensors (entries
that are the very same tensor, such as a language model's ``lm_head.weight``
and its input embedding) are stored once; the other names are aliases in the
index, and :func:`load_compressed` gives them the same tensor again.

The container is a `safetensors <https://github.com/huggingface/safetensors>`_
file written by the ``safetensors`` package: no pickle. Its metadata holds an
index (name, encoding, dtype, shape, number of non-zeros and a SHA-256 of the
original bytes of every tensor) and a SHA-256 of that index; with
``key=...`` also an HMAC-SHA-256 of the index, which authenticates the whole
file (the index pins every stored tensor's name, dtype, shape and checksum).

:func:`load_compressed` treats the file as hostile. Before decoding anything
it checks, through :mod:`prunekit.io.reader`, that the path is a regular
file, that the safetensors header fits the file (strict JSON, byte ranges that
match the shapes, do not overlap and cover the buffer) and that the index is
exactly what prunekit writes: known keys and types only, known dtypes and
encodings, each name once, and one stored tensor of exactly the expected
dtype and shape for each part of each entry, none missing, none extra. Any
failure -- and a bitmask population, a tensor checksum or a signature that
does not verify -- raises :class:`CorruptCheckpointError` (a ``ValueError``)
naming the path and the reason. A file that carries any of prunekit's
metadata keys or stored-entry suffixes is held to all of these rules, so a
flipped bit in a metadata key is an error, not a plain safetensors file.

Work and memory are linear in the file: each stored byte is read once; the
decoded tensors take at most ``8 x element size`` bytes per stored bitmask
byte (a bitmask expands to that) and the size of the stored values otherwise.
An index that names a tensor twice is refused before any tensor is read.

The round trip is bit-exact for every dtype (float64/32/16, bfloat16, float8
variants, complex, every integer width, bool): NaN payloads are kept as values,
and ``-0.0`` -- which ``w * mask`` leaves wherever a negative weight was pruned
-- is restored from one extra bit per zero element, stored only for tensors
that hold one (``keep_zero_sign=False`` stores it as ``0.0`` instead, for a
smaller file). Dtypes that safetensors has no tag for (complex128, ...) are
stored as raw bytes and re-typed on load.

Writing needs the ``safetensors`` package (``pip install prunekit[io]``);
reading does not.

The package's modules: :mod:`.codec` (one tensor to its stored parts and
back, the format's names and signature), :mod:`.writer` (:func:`write_compressed`,
:class:`CompressedWriter`) and :mod:`.reader` (:func:`load_compressed`, the
validation of a hostile file).
"""

from __future__ import annotations

from ..errors import CheckpointSignatureError, CorruptCheckpointError
from .codec import FORMAT_NAME
from .reader import UnverifiedSignatureWarning, is_compressed_header, load_compressed
from .writer import CompressedWriter, drop_masked, write_compressed

__all__ = [
    "CompressedWriter",
    "drop_masked",
    "write_compressed",
    "load_compressed",
    "is_compressed_header",
    "CorruptCheckpointError",
    "CheckpointSignatureError",
    "UnverifiedSignatureWarning",
    "FORMAT_NAME",
]
