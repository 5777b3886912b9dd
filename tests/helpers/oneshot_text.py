"""The one-shot tests' and benchmarks' calibration and evaluation text: it ships in the package."""

from prunekit.demo.text import calibration_and_evaluation, sentences

__all__ = ["calibration_and_evaluation", "sentences"]
