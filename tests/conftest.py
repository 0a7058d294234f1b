"""Session-wide setup: 8 simulated CPU devices for the mesh tests in
tests/mesh/.

XLA reads XLA_FLAGS once, when jax is first imported, so this must run before
any test module imports jax. Tests that do not use a mesh are unaffected: they
run on the default device, cpu:0.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
