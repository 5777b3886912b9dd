"""Proofs: which masked channels are provably constant, and so which units are dead.

:mod:`.constants` holds the facts (a layer's proved output values, and the const maps the
tracer carries along the run); :mod:`.dead` reads them off a traced graph and decides,
per unit, whether removing it can change the masked model's output.
"""
