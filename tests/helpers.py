"""Helpers shared by the test folders (tests/, tests/peers/, tests/mesh/).

tests/conftest.py puts this folder on ``sys.path``, so every test module can
``import helpers``. Peer drivers, which need PyTorch, live in
tests/peers/oracles.py instead.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np

# No jax import at module level: tests/conftest.py imports this module before
# jax loads, to set XLA_FLAGS.

TINY = float(np.finfo(np.float32).tiny)  # float32's smallest normal, 2**-126
F32_MAX = float(np.finfo(np.float32).max)

# The random tests' seed; set FP16_SCALING_PEER_SEED to draw another set.
SEED = int(os.environ.get("FP16_SCALING_PEER_SEED", "20250611"))

# XLA reads XLA_FLAGS once, when jax first initialises a backend.
DEVICES_FLAG = "--xla_force_host_platform_device_count=8"

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository

# float32's and float16's unit roundoffs: a correctly rounded operation's
# result is within these of its exact value, relatively (normal results).
U32 = 2.0**-24
U16 = 2.0**-11

# The most units in the last place a float32 square root may be off its
# correctly rounded value on any backend the tests state a bound for:
# XLA:CPU rounds correctly (0); XLA:GPU may lower it to CUDA's approximate
# form, at most 1 ulp off on compute capability 5.2 and later and 3 before
# (CUDA C++ Programming Guide, "Mathematical Functions": sqrtf without
# -prec-sqrt). An H200 was seen 1 ulp off on sqrt(5).
SQRT_ULPS = 3


def with_eight_devices(flags: str) -> str:
  """``flags`` (an XLA_FLAGS value) with 8 simulated CPU devices."""
  if DEVICES_FLAG in flags:
    return flags
  return f"{flags} {DEVICES_FLAG}".strip()


def without_device_count(flags: str) -> str:
  """``flags`` without a simulated device count: one device, as users run."""
  return " ".join(
    f
    for f in flags.split()
    if not f.startswith("--xla_force_host_platform_device_count")
  )


def load_script(path):
  """A script of the repository (benchmarks/, examples/) as a module, its
  ``main`` not run."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_script(path, *args, timeout=600) -> subprocess.CompletedProcess:
  """``python path args`` from the repository root, as a user runs it: on one
  device, without the 8 simulated ones tests/conftest.py sets up."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = without_device_count(env.get("XLA_FLAGS", ""))
  return subprocess.run(
    [sys.executable, str(path), *map(str, args)],
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=ROOT,
    env=env,
  )


def table_rows(text) -> dict:
  """``{first cell: [the other cells]}`` of every markdown table row in
  ``text`` (header and separator rows included, stripped of spaces)."""
  rows = {}
  for line in text.splitlines():
    if line.startswith("| ") and line.rstrip().endswith("|"):
      cells = [c.strip() for c in line.strip()[1:-1].split("|")]
      rows[cells[0]] = cells[1:]
  return rows


def bits(tree) -> list:
  """Every leaf's bytes: equal lists mean bit-identical trees."""
  import jax

  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def guarded(scaler, *tail, **loss_scale_kwargs):
  """``chain(fp16_loss_scale(scaler, **loss_scale_kwargs),
  *tail)``: the guarded chain, ``tail`` (a clip, an optimizer) after the
  loss scale."""

  import fp16_scaling as fs

  return fs.chain(fs.fp16_loss_scale(scaler, **loss_scale_kwargs), *tail)


def nested_params() -> dict:
  """A small nested float32 parameter tree (a ``-0.0`` included), the same
  on every call: the skip and accumulation tests' parameters."""
  import jax
  import jax.numpy as jnp

  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "dense": {
      "kernel": jax.random.normal(k1, (4, 3)),
      "bias": jnp.array([0.0, -0.0, 1.0]),
    },
    "out": jax.random.normal(k2, (3,)),
  }


def _is_bookkeeping(x) -> bool:
  import fp16_scaling as fs

  return isinstance(x, (fs.LossScaleState, fs.ClipState))


def strip_bookkeeping(state):
  """``state`` without the loss-scale and clip states, the parts that move on
  an overflow step: what is left must keep every bit."""
  import jax

  return jax.tree.map(
    lambda x: None if _is_bookkeeping(x) else x,
    state,
    is_leaf=_is_bookkeeping,
  )


def replay_scalers(scalers, overflows):
  """Each scaler's scale and cumulative ``min_scale_errors`` after every step
  of its overflow sequences (``overflows[i]``: [sequence, step] bools for
  ``scalers[i]``), ``Scaler.update`` under ``lax.scan``, vmapped over the
  sequences: two arrays [scaler, sequence, step]. One jit runs them all (a
  jit per scaler spent most of its time compiling)."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def run(flags):
    out = []
    for scaler, f in zip(scalers, flags):

      def body(state, flag, scaler=scaler):
        state = scaler.update(state, flag)
        return state, (state.loss_scale, state.min_scale_errors)

      def one(f, scaler=scaler, body=body):
        return jax.lax.scan(body, scaler.init(), f)[1]

      out.append(jax.vmap(one)(f))
    return jax.tree.map(lambda *xs: jnp.stack(xs), *out)

  scales, errors = run(jnp.asarray(overflows))
  return np.asarray(scales, np.float64), np.asarray(errors)


def jaxpr_eqns(jaxpr, out=None) -> list:
  """Every equation of ``jaxpr`` and of the jaxprs inside its equations
  (jit, custom_jvp, scan bodies), appended to ``out``."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    out.append(e)
    for v in e.params.values():
      for w in v if isinstance(v, (list, tuple)) else [v]:
        if hasattr(w, "eqns"):
          jaxpr_eqns(w, out)
        elif hasattr(getattr(w, "jaxpr", None), "eqns"):
          jaxpr_eqns(w.jaxpr, out)
  return out


def assert_same_bits(a, b):
  """``a`` and ``b`` have one tree structure and bit-identical leaves."""
  import jax

  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert bits(a) == bits(b)


def orbax_round_trip(path, tree, target=None):
  """``tree`` saved by orbax's StandardCheckpointer at ``path`` and restored
  (into ``target``, or untyped without one)."""
  import orbax.checkpoint as ocp

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, tree)
  ckpt.wait_until_finished()
  return (
    ckpt.restore(path, target) if target is not None else ckpt.restore(path)
  )


def free_port() -> int:
  """A free TCP port on the loopback interface."""
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(cmds, env, timeout=110) -> list:
  """Starts every command of ``cmds`` at once with ``env`` (the repository
  first on its PYTHONPATH) and waits for them all: ``[(returncode, stdout
  and stderr)]``. Any still running when one passes ``timeout`` is killed."""
  env = dict(env)
  path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + path)
  procs = [
    subprocess.Popen(
      cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for cmd in cmds
  ]
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [(p.returncode, log) for p, log in zip(procs, logs)]


def on_cpu() -> bool:
  """Whether JAX runs on XLA:CPU: the backend that recorded tests/data and
  the one whose exact results (no float16 convert pair folded away, no
  contraction into FMA, correctly rounded square roots) the tests pin bit
  for bit. Elsewhere they hold the bound each test derives."""
  import jax

  return jax.default_backend() == "cpu"


def gamma(n) -> float:
  """Higham's gamma_n = n u / (1 - n u) for float32: the relative error
  bound of a product of n roundings, or of a sum of n + 1 non-negative
  float32 terms added in any order."""
  return n * U32 / (1 - n * U32)


def ulps(a, b) -> np.ndarray:
  """How many float32 values lie between ``a`` and ``b``, elementwise: 0
  for the same value (+0.0 and -0.0 included), 1 for neighbours."""
  ordered = []
  for x in (a, b):
    i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    ordered.append(np.where(i < 0, -(i & 0x7FFFFFFF), i))
  return np.abs(ordered[0] - ordered[1])


def first_order_bound(fn, sites, rel):
  """A first-order bound on how far ``fn``'s output moves when every value
  it multiplies by ``1 + e`` is rounded differently, by a relative error of
  at most ``rel``: sum over j of ``|d fn(e) / d e_j| * rel_j`` at ``e = 0``
  (the classic forward propagation of backward errors, exact to first order
  in the roundoff).

  Args:
    fn: a function of ``sites`` (a pytree of float32 arrays, each a relative
      perturbation of one intermediate value); returns a pytree of arrays.
    sites: the zero perturbations, as ``fn`` takes them.
    rel: a pytree of floats with the structure of ``sites``: each site's
      largest relative error.

  Returns:
    A pytree like ``fn(sites)`` of float64 numpy arrays.
  """
  import jax

  shapes = jax.eval_shape(fn, sites)
  out_def = jax.tree.structure(shapes)
  outs = jax.tree.leaves(shapes)
  wide = [k for k, out in enumerate(outs) if is_float(out)]

  def float_outputs(sites):
    leaves = jax.tree.leaves(fn(sites))
    return [leaves[k] for k in wide]

  # Eagerly: compiling the Jacobian of a few unrolled optimizer steps takes
  # far longer than running it on a few dozen values.
  jacobians = dict(zip(wide, jax.jacrev(float_outputs)(sites)))
  # An integer or bool output does not depend on the perturbations: 0.
  bounds = [np.zeros(out.shape) for out in outs]
  for k, jacobian in jacobians.items():
    for j, r in zip(jax.tree.leaves(jacobian), jax.tree.leaves(rel)):
      j = np.abs(np.asarray(j, np.float64)).reshape(outs[k].shape + (-1,))
      bounds[k] += r * j.sum(axis=-1)
  return jax.tree.unflatten(out_def, bounds)


def is_float(x) -> bool:
  """Whether ``x`` (an array, traced or not, or a number) is floating
  point."""
  import jax.numpy as jnp

  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def times(tree, e):
  """``tree`` with each leaf multiplied by ``1 + `` its leaf of ``e``: a
  relative perturbation site for :func:`first_order_bound`."""
  import jax

  return jax.tree.map(lambda x, r: x * (1 + r), tree, e)


def times_floats(state, e):
  """``state`` with its floating-point leaves, in order, multiplied by ``1 +
  `` the arrays of the list ``e`` (integer and bool leaves kept)."""
  import jax

  leaves, treedef = jax.tree.flatten(state)
  rel = iter(e)
  leaves = [x * (1 + next(rel)) if is_float(x) else x for x in leaves]
  return jax.tree.unflatten(treedef, leaves)


def float_sites(state) -> list:
  """Zero perturbations for the floating-point leaves of ``state``, as
  :func:`times_floats` takes them."""
  import jax
  import jax.numpy as jnp

  return [
    jnp.zeros(jnp.shape(x)) for x in jax.tree.leaves(state) if is_float(x)
  ]
