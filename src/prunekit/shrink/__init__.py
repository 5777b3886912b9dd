"""Shrink: a pretrained Hugging Face model made into a smaller dense one from calibration data.

Width (hidden size, heads, key/value groups, FFN neurons, experts) and depth (whole
layers) are removed by importance measured on calibration batches; the result is a
plain Hugging Face model whose config describes its new shapes.
"""

from .families import FAMILIES, ShrinkFamily, family_of, layer_list
from .distill import DistillReport, distill

__all__ = ["FAMILIES", "DistillReport", "ShrinkFamily", "distill", "family_of", "layer_list"]
