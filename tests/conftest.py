"""Session-wide setup: 8 simulated CPU devices for the mesh tests in
tests/mesh/.

XLA reads XLA_FLAGS once, when jax is first imported, so this must run before
any test module imports jax. Tests that do not use a mesh are unaffected: they
run on the default device, cpu:0. This folder is on ``sys.path`` (pytest puts
a rootless conftest's folder there), so test modules can ``import helpers``.
"""

import os

import helpers

os.environ["XLA_FLAGS"] = helpers.with_eight_devices(
  os.environ.get("XLA_FLAGS", "")
)
