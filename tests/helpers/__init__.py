"""What the tests share: model builders, calibration text, fault injection and the process harness.

* ``compact_models`` -- small CNN/MLP/encoder modules for compaction; ``cli_models`` -- the
  ``module.py:function`` builders the command line loads; ``hf_models`` and ``shrink_models`` --
  small random ``transformers`` models of every family (``shrink_models.build(family)``,
  ``batches(family)``, ``ZOO``); ``vision_models`` -- torchvision/timm builders for the zoo matrices;
* ``oneshot_text`` -- calibration and held-out sentences that ship with Python;
* ``interrupts`` and ``torch_faults`` -- a failure or ``KeyboardInterrupt`` injected at every step;
* ``dist_harness`` (processes joined by gloo), ``dist_scenarios`` and ``dist_oneshot_scenarios``
  (what each rank runs), ``sharded_threads`` (ranks as threads).

Test modules import them as ``from helpers import shrink_models as S``.
"""
