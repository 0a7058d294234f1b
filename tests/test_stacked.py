"""stacked_axes: a scanned stack of 8 layers in which only layer 5 overflows
is named by layer (axis 0 and axis 1, under jit, vmap and accumulation); the
per-layer norms are the unstacked model's leaf norms; a state built without
stacked_axes keeps its fields and restores an older checkpoint."""

import base64

import flax.serialization
from helpers import SQRT_ULPS
from helpers import U32
from helpers import bits
from helpers import gamma
from helpers import guarded
from helpers import on_cpu
from helpers import ulps
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.tree_util import tree_flatten_with_path as flatten_with_path
import numpy as np
import optax
import pytest

import fp16_scaling as fs

L, D, HOT = 8, 4, 5


def stacked_params(axis, key=0):
  kw, kb = jax.random.split(jax.random.PRNGKey(key))
  w = jax.random.normal(kw, (L, D, D)) / D
  b = jax.random.normal(kb, (L, D)) * 0.1
  return {"layers": {"W": jnp.moveaxis(w, 0, axis), "b": b}, "out": jnp.ones(D)}


def block(h, w, b):
  return h + jnp.tanh(h @ w + b)


def loss_fn(params, x, axis, amp):
  """The float16 residual stack applied by lax.scan; ``amp`` multiplies
  each layer's kernel gradient (not its value)."""
  p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  w = jnp.moveaxis(p16["layers"]["W"], axis, 0)
  w = w + (amp[:, None, None] - 1) * (w - lax.stop_gradient(w))

  def body(h, wb):
    return block(h, *wb), None

  h, _ = lax.scan(body, x.astype(jnp.float16), (w, p16["layers"]["b"]))
  return jnp.mean((h @ p16["out"]).astype(jnp.float32) ** 2)


def make_tx(axis, **kw):
  stacked = {"layers": {"W": axis, "b": 0}, "out": None}
  scaler = fs.static_scaler(2.0**8)
  clip = fs.clip_by_unscaled_norm(1.0)
  return guarded(scaler, clip, optax.sgd(0.1), stacked_axes=stacked, **kw)


def amp(hot):
  return jnp.ones(L, jnp.float16).at[HOT].set(jnp.where(hot, 6e4, 1.0))


X = jax.random.normal(jax.random.PRNGKey(1), (16, D))


def grads_of(params, state, axis, hot):
  """The scaled float16 gradients (the params cast inside the loss)."""
  p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  return fs.value_and_grad(loss_fn, state)(p16, X, axis, amp(hot))[1]


def assert_names_layer_5(report):
  assert report.step_overflowed
  assert report.nonfinite_leaves == ("['layers']['W'][5]",)
  assert report.nonfinite_layers == (HOT,)
  assert report.layer_counts == {HOT: 1}
  assert report.counts == {"['layers']['W'][5]": 1}
  text = str(report)
  assert "  ['layers']['W'][5]\n" in text and "  1  layer 5\n" in text


@pytest.mark.parametrize("axis", [0, 1])
def test_jit_names_layer_5_in_report_log_and_range(axis, capsys):
  tx = make_tx(axis, grad_range=True, log_overflows=True)
  params = stacked_params(axis)
  state = tx.init(params)

  @jax.jit
  def step(params, state, hot):
    updates, state = tx.update(
      grads_of(params, state, axis, hot), state, params
    )
    return optax.apply_updates(params, updates), state

  params, state = step(params, state, False)
  assert not fs.overflow_report(state).step_overflowed
  params, state = step(params, state, True)
  jax.effects_barrier()
  assert_names_layer_5(fs.overflow_report(state))
  log = capsys.readouterr().out
  assert "leaves (1): ['layers']['W'][5]\n" in log
  m = fs.scale_metrics(state)
  assert int(m["nonfinite_leaves"]) == 1 and int(m["nonfinite_layers"]) == 1
  report = fs.overflow_report(state)
  assert set(report.grad_range) == set(state[0].leaf_paths.paths)
  assert len(report.grad_range) == 2 * L + 1


def test_vmap_names_layer_5_in_the_member_that_overflowed():
  tx = make_tx(0)
  params = stacked_params(0)
  states = jax.vmap(tx.init)(jax.tree.map(lambda p: jnp.stack([p, p]), params))

  def step(state, hot):
    updates, state = tx.update(grads_of(params, state, 0, hot), state, params)
    return state

  states = jax.jit(jax.vmap(step))(states, jnp.array([False, True]))

  def member(i):
    return jax.tree.map(lambda x: x[i], states)

  assert not fs.overflow_report(member(0)).step_overflowed
  assert_names_layer_5(fs.overflow_report(member(1)))
  m = fs.scale_metrics(states)
  assert m["nonfinite_layers"].tolist() == [0, 1]


@pytest.mark.parametrize("axis", [0, 1])
def test_accumulation_names_layer_5_of_the_window(axis):
  inner = make_tx(axis)
  tx = fs.accumulate_gradients(inner, 2)  # the chain's stacked_axes
  params = stacked_params(axis)
  state = tx.init(params)
  step = jax.jit(lambda s, hot: tx.update(grads_of(params, s, axis, hot), s))
  for hot in (False, True):
    _, state = step(state, hot)
  assert_names_layer_5(fs.overflow_report(state))


def _leaf_norm_rel(n):
  """The relative bound of a float32 norm of ``n`` float16 values against
  their float64 norm, on any backend: each square is exact in float32 (11
  significant bits squared fit in 24), their sum in any order is within
  gamma_{n-1} (halved by the square root), the square root within SQRT_ULPS
  ulp (2 u each) of its correctly rounded value, which is within u; the
  division by the power-of-two scale is exact."""
  return gamma(n - 1) / 2 + (2 * SQRT_ULPS + 1) * U32


def _unstacked_loss(layers, out):
  h = X.astype(jnp.float16)
  for w, b in layers:
    h = block(h, w.astype(jnp.float16), b.astype(jnp.float16))
  return jnp.mean((h @ out.astype(jnp.float16)).astype(jnp.float32) ** 2)


def test_layer_norms_equal_the_unstacked_leaf_norms():
  """The same weights as 8 leaves per kind, applied one by one: each
  layer's norm is the float64 norm of that layer's leaf, within
  _leaf_norm_rel, for the stacked model's gradients and for the unstacked
  model's gradients stacked (each made in a jit of its own, so that the
  step reads the float16 values as stored).

  The two models' float16 gradients are bit for bit the same on XLA:CPU,
  which rounds every float16 result to float16 in either program. Not
  elsewhere: XLA:GPU keeps float16 intermediates at float32 precision
  inside its fusions and accumulates float16 dots in float32 on tensor
  cores, differently in a scan and in an unrolled loop (an H200's two
  were up to 3.5e-4 apart in a layer's norm). That is the model's float16
  arithmetic, not the library's: elsewhere each model is checked alone."""
  tx = make_tx(1, grad_range=True)
  params = stacked_params(1)
  state = tx.init(params)
  scale = float(fs.current_scale(state))
  stacked = jax.jit(grads_of, static_argnums=(2, 3))(params, state, 1, False)

  w = jnp.moveaxis(params["layers"]["W"], 1, 0)
  layers = [(w[i], params["layers"]["b"][i]) for i in range(L)]
  grads = jax.jit(jax.grad(_unstacked_loss))(
    jax.tree.map(lambda p: p.astype(jnp.float16), layers), params["out"]
  )
  # Scaled as the step expects (a power of two: exact in float16 here).
  unstacked = {
    "layers": {
      "W": jnp.stack([g[0] for g in grads], axis=1) * scale,
      "b": jnp.stack([g[1] for g in grads]) * scale,
    },
    "out": stacked["out"],
  }
  if on_cpu():
    assert bits(stacked) == bits(unstacked)
  step = jax.jit(lambda g, s: tx.update(g, s)[1])
  for scaled in (stacked, unstacked):
    norms = fs.layer_grad_norms(step(scaled, state))
    for kind, axis, size in (("W", 1, D * D), ("b", 0, D)):
      g = np.asarray(scaled["layers"][kind], np.float64) / scale
      want = [np.linalg.norm(np.take(g, i, axis=axis)) for i in range(L)]
      got = np.asarray(norms[f"['layers']['{kind}']"], np.float64)
      np.testing.assert_allclose(got, want, rtol=_leaf_norm_rel(size), atol=0)
  with pytest.raises(ValueError, match="grad_range=True"):
    fs.layer_grad_norms(make_tx(1).init(params))


# flax.serialization.to_bytes of a state built without stacked_axes by the
# code just before stacked_axes existed (this release's LossScaleState, with
# consecutive_skipped_steps; nothing older was released):
# deepspeed_scaler(init_scale=2**8, scale_window=2), grad_range=True, the
# clip and sgd(0.1), over OLD_PARAMS, after the three steps of old_steps (an
# inf in ['layers']['W'][5, 0] on the second).
OLD_CHECKPOINT = """
g6Ewi6ZzY2FsZXKFqmxvc3Nfc2NhbGXYAZOQp2Zsb2F0MzLEBAAAAEOuZ3Jvd3RoX3RyYWNrZXLH
DgGTkKVpbnQzMsQEAAAAAK9oeXN0ZXJlc2lzX2xlZnTHDgGTkKVpbnQzMsQEAAAAALBtaW5fc2Nh
bGVfZXJyb3Jzxw4Bk5ClaW50MzLEBAAAAACvZmxvb3Jfb3ZlcmZsb3dzxw4Bk5ClaW50MzLEBAAA
AACvcHJldl9sb3NzX3NjYWxl2AGTkKdmbG9hdDMyxAQAAABDqG92ZXJmbG93xwoBk5CkYm9vbMQB
AK1za2lwcGVkX3N0ZXBzxw4Bk5ClaW50MzLEBAEAAAC5Y29uc2VjdXRpdmVfc2tpcHBlZF9zdGVw
c8cOAZOQpWludDMyxAQAAAAAqWdyYWRfbm9ybdgBk5CnZmxvYXQzMsQEkqVLPa5sZWFmX25vbmZp
bml0ZccMAZORAqRib29sxAIAALRsZWFmX25vbmZpbml0ZV9zdGVwc8cTAZORAqVpbnQzMsQIAQAA
AAAAAACtb3ZlcmZsb3dfa2luZMcOAZOQpWludDMyxAQAAAAAqmdyYWRfcmFuZ2WCp21heF9hYnPH
FQGTkQKnZmxvYXQzMsQIAABAPAAAQDytemVyb19mcmFjdGlvbscVAZORAqdmbG9hdDMyxAgAAAAA
AAAAAKpsZWFmX3BhdGhzgKExg6lncmFkX25vcm3YAZOQp2Zsb2F0MzLEBJKlSz2wZXhwZXJ0X2dy
YWRfbm9ybdgBk5CnZmxvYXQzMsQEAAAAALBzaGFyZWRfZ3JhZF9ub3Jt2AGTkKdmbG9hdDMyxASS
pUs9oTKCoTCAoTGA
"""
OLD_PARAMS = {"layers": {"W": jnp.ones((8, 2))}, "out": jnp.ones(2)}


def old_steps(tx):
  state = tx.init(OLD_PARAMS)
  for i in range(3):
    g = jax.tree.map(
      lambda p: jnp.full(p.shape, 0.5 * (i + 1), jnp.float16), OLD_PARAMS
    )
    if i == 1:
      g["layers"]["W"] = g["layers"]["W"].at[5, 0].set(jnp.inf)
    _, state = tx.update(g, state, OLD_PARAMS)
  return state


def test_a_state_without_stacked_axes_restores_an_older_checkpoint():
  scaler = fs.deepspeed_scaler(init_scale=2.0**8, scale_window=2)
  clip = fs.clip_by_unscaled_norm(1.0)
  tx = guarded(scaler, clip, optax.sgd(0.1), grad_range=True)
  target = tx.init(OLD_PARAMS)
  fields = "scaler prev_loss_scale overflow skipped_steps "
  fields += "consecutive_skipped_steps grad_norm leaf_nonfinite "
  fields += "leaf_nonfinite_steps overflow_kind scale_set grad_range "
  assert fs.LossScaleState._fields == tuple((fields + "leaf_paths").split())
  assert type(target[0].grad_range) is fs.GradRange
  saved = flax.serialization.msgpack_restore(base64.b64decode(OLD_CHECKPOINT))
  # Saved before the state's scale_set field: restored as it is, refused;
  # with CHANGELOG.md's one-line migration (the field, not set), restored.
  with pytest.raises(ValueError, match="field names .* do not match"):
    flax.serialization.from_state_dict(target, saved)
  saved["0"]["scale_set"] = np.bool_(False)
  restored = flax.serialization.from_state_dict(target, saved)
  now = old_steps(tx)
  assert jax.tree.structure(restored) == jax.tree.structure(now)
  # Recorded on XLA:CPU: bit for bit there. On any backend every leaf but
  # the norms, bit for bit; each norm (the loss scale's, the clip's and
  # its shared part) within SQRT_ULPS ulp: the squares of 0.5, 1 and 1.5
  # are multiples of 2**-2 whose sums stay below 2**6, exact in float32 in
  # any order, and the scale is a power of two: only the square root
  # rounds (an H200 was 1 ulp off).
  if on_cpu():
    assert bits(restored) == bits(now)
  old, _ = flatten_with_path(restored)
  for (path, a), b in zip(old, jax.tree.leaves(now)):
    if jax.tree_util.keystr(path).endswith("grad_norm"):
      assert ulps(a, b) <= SQRT_ULPS, path
    else:
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path
  assert fs.overflow_report(restored).counts == {"['layers']['W']": 1}


def test_stacked_axes_is_checked_with_the_parameter_and_its_range():
  params = stacked_params(0)

  def build(stacked_axes, **options):
    scale = fs.fp16_loss_scale(
      fs.static_scaler(1.0), stacked_axes=stacked_axes, **options
    )
    return fs.chain(scale).init(params)[0]

  with pytest.raises(TypeError, match="stacked_axes must be a pytree prefix"):
    fs.fp16_loss_scale(fs.static_scaler(1.0), stacked_axes={"layers": 0.5})
  with pytest.raises(
    ValueError, match=r"\['out'\] \(ndim 1\) the layer axis 1"
  ):
    build({"layers": 0, "out": 1})
  with pytest.raises(ValueError, match=r"\['layers'\]\['W'\] has 8.*has 4"):
    build({"layers": {"W": 0, "b": 1}, "out": None})
  with pytest.raises(ValueError, match="split over mesh axis 'stage'"):
    specs = {"layers": P("stage"), "out": P()}
    build({"layers": 0, "out": None}, partition_specs=specs)
  # Negative axes are normalised; fs.stacked_under gives the same layout.
  # Resolved, the two give one layout (tx.init keeps it in the state's treedef).
  a = {"layers": {"W": -3, "b": -2}, "out": None}
  b = fs.stacked_under("layers")
  for stacked_axes in (a, b):
    build(stacked_axes)  # both fit
  a, b = (
    fs.fp16_loss_scale(fs.static_scaler(1.0), stacked_axes=axes).config
    for axes in (a, b)
  )
  a, b = a.layout(params), b.layout(params)
  assert a.axes == b.axes == (0, 0, None)
  assert a.layers == b.layers == L


def test_diagnostics_md_shows_the_by_layer_report_as_it_prints(capsys):
  import re

  import docs_snippets

  text = (docs_snippets.DOCS / "diagnostics.md").read_text()
  section = text[text.index("## Stacked layers: the report by layer") :]
  code, shown = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)[:2]
  exec(compile(code, "diagnostics.md, by layer", "exec"), {})
  assert capsys.readouterr().out == shown


def test_the_layout_is_resolved_once_by_init_and_held_in_the_treedef(
  monkeypatch,
):
  """``stacked_axes`` are resolved on the params once, by ``tx.init``, into
  the state's treedef (``leaf_paths.layout``, hashable): the updates (two
  traces here, float32 and float16 gradients) read it from there, and
  the closure keeps no cache of it."""
  from fp16_scaling import _stacked

  calls = []
  resolve = _stacked.resolve

  def counted(*args):
    calls.append(args[0])
    return resolve(*args)

  monkeypatch.setattr(_stacked, "resolve", counted)
  params = stacked_params(0)
  tx = guarded(
    fs.static_scaler(1.0),
    optax.sgd(0.1),
    stacked_axes=fs.stacked_under("layers"),
  )
  state = tx.init(params)
  assert len(calls) == 1
  step = jax.jit(tx.update)
  for dtype in (jnp.float32, jnp.float16):
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, dtype), params)
    _, state = step(grads, state, params)
  _, state = tx.update(grads, state, params)  # eager too
  assert len(calls) == 1  # no update resolved it again
  units = state[0].leaf_paths
  assert units.layers == L
  assert units.stacks == (("['layers']['W']", 0), ("['layers']['b']", L))
  assert len(units.paths) == len(units.sizes) == 2 * L + 1
  assert units.layout.axes == (0, 0, None) and hash(units.layout)
  assert not any(isinstance(v, dict) for v in vars(tx.config.scale).values())


def test_a_state_of_other_stacked_axes_or_specs_is_refused_where_it_enters():
  """A state built with other ``stacked_axes`` (its units are other
  layers) or other ``partition_specs`` is refused by the update it enters,
  naming which, eager and jitted alike (the treedef holds both); one of
  an equal configuration is not (``stacked_under`` specs compare by
  value)."""
  params = stacked_params(0)
  grads = jax.tree.map(jnp.ones_like, params)

  def tx(**kw):
    return guarded(fs.static_scaler(1.0), optax.sgd(0.1), **kw)

  under = tx(stacked_axes=fs.stacked_under("layers"))
  state = under.init(params)
  others = [
    tx(),
    tx(stacked_axes={"layers": 0, "out": None}),
    tx(stacked_axes=fs.stacked_under("layers"), partition_specs=P()),
  ]
  names = ("stacked_axes", "stacked_axes", "partition_specs")
  for other, what in zip(others, names):
    for update in (other.update, jax.jit(other.update)):
      with pytest.raises(ValueError, match=f"built with other {what}"):
        update(grads, state, params)
  same = tx(stacked_axes=fs.stacked_under("layers"))
  _, state = same.update(grads, state, params)
  assert len(state[0].leaf_paths.paths) == 2 * L + 1


def test_tree_map_params_maps_a_stacked_grad_range_state():
  """optax.tree_map_params inits the chain on a leafless placeholder and
  maps the real state onto it: with stacked_axes and grad_range the
  placeholder's range is a StackedRange too (its kind follows the
  configuration, not the leaves), so the map keeps the state's structure
  and marks its per-unit vectors as non-params."""
  tx = make_tx(0, grad_range=True)
  state = tx.init(stacked_params(0))
  assert type(state[0].grad_range) is fs.StackedRange
  shapes = optax.tree_map_params(
    tx, lambda p: p.shape, state, transform_non_params=lambda _: None
  )
  assert type(shapes[0].grad_range) is fs.StackedRange
  assert shapes[0].grad_range.unit_norm is None
