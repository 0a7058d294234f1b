"""worker.py is a script that each launched process runs, not a test module.

``--doctest-modules`` would import it, and its module-level XLA_FLAGS (two
devices per process) would then reach the pytest process before jax loads.
"""

collect_ignore = ["worker.py"]
