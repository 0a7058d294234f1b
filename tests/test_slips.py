"""A newcomer's slips that used to pass silently (issue 40), each now
refused with a message that names the fix, or made correct: a stacked name
that matches nothing, equal stacked specs, a layer axis the partition names
contradict, a sync of nnx optimizers dropped on the floor, a second sync (it
changes nothing; the sync of the states from before the step is documented
behaviour, tests/test_refusals.py), a cast audit of a checkpoint that
already holds an inf, ``tx.init`` on an unfiltered Equinox module, and the
report's rows for fully non-finite leaves."""

import warnings

from helpers import bits
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp16_scaling as fs

L, D = 8, 16


def stacked_params():
  k0, k1 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "layers": {"w": jax.random.normal(k0, (L, D, D)), "b": jnp.zeros((L, D))},
    "head": jax.random.normal(k1, (D, 2)),
  }


def chain(scaler=None, **kw):
  scaler = scaler or fs.torch_scaler(init_scale=2.0**10)
  return fs.chain(fs.fp16_loss_scale(scaler, **kw), optax.sgd(0.1))


# ------------------------------------------- 1: stacked_under's names


@pytest.mark.parametrize("name", ["blocks", "layer"])
def test_stacked_under_a_name_that_matches_nothing_is_refused(name):
  tx = chain(stacked_axes=fs.stacked_under(name))
  with pytest.raises(ValueError) as e:
    tx.init(stacked_params())
  msg = str(e.value)
  assert "fp16_loss_scale: stacked_axes:" in msg
  assert f"named '{name}'" in msg and "matches no leaf" in msg
  # The keys it found, so that the fix can be read off.
  assert "'head', 'layers'" in msg
  if name == "layer":
    assert "Did you mean 'layers'?" in msg
  with pytest.raises(ValueError, match=r'fs.stacked_under\("layers"\)'):
    fs.stacked_under()


def test_stacked_under_takes_a_list_and_equal_calls_are_one_spec():
  a, b = fs.stacked_under("layers"), fs.stacked_under(["layers"])
  assert a == b and hash(a) == hash(b)
  assert fs.stacked_under("a", "b") == fs.stacked_under(["b", "a"])
  assert a != fs.stacked_under("layers", axis=1)
  with pytest.raises(TypeError, match="each name must be a str.*got 3"):
    fs.stacked_under(3)
  with pytest.raises(TypeError, match="axis must be an int"):
    fs.stacked_under("layers", axis=1.0)
  params = stacked_params()
  # A state built with one call is the state of a chain built with the
  # other (before, two lambdas: "built with other stacked_axes").
  state = chain(stacked_axes=a).init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = chain(stacked_axes=b).update(grads, state, params)
  assert len(state[0].leaf_paths.paths) == 2 * L + 1
  # And under accumulate_gradients, which runs the chain's: the layout its
  # closure resolved, and the units it names in the state.
  step = chain(stacked_axes=a)
  inner = fs.accumulate_gradients(step, 2).init(params).inner_state[0]
  assert step.config.scale.layout(params).axes == (None, 0, 0)  # head, b, w
  assert len(inner.leaf_paths.paths) == 2 * L + 1


# --------------------------- 2: a layer axis the partition names contradict


def test_a_layer_axis_the_partition_names_contradict_is_refused():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      init = nn.with_partitioning(nn.initializers.ones, ("embed", "mlp"))
      return x @ self.param("w", init, (4, 4)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      scan = nn.scan(
        Block,
        variable_axes={"params": 1},  # MaxText's param_scan_axis
        split_rngs={"params": True},
        length=4,
        metadata_params={nn.PARTITION_NAME: "layers"},
      )
      return scan(name="layers")(x, None)[0]

  params = Model().init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
  # [embed 4, layers 4, mlp 4]: every axis has 4, so only the names tell.
  with pytest.raises(ValueError) as e:
    chain(stacked_axes=fs.stacked_under("layers")).init(params)
  msg = str(e.value)
  assert "('embed', 'layers', 'mlp') put 'layers' on axis 1" in msg
  assert "Pass axis=1" in msg
  tx = chain(stacked_axes=fs.stacked_under("layers", axis=1))
  tx.init(params)
  assert tx.config.scale.layout(params).axes == (1,)


# ------------------------------------- 3: nnx optimizers synced in place


def test_sync_of_nnx_optimizers_acts_in_place():
  nnx = pytest.importorskip("flax.nnx")
  scaler = fs.torch_scaler(init_scale=2.0**20)
  models = [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(2)]
  opts = [nnx.Optimizer(m, chain(scaler), wrt=nnx.Param) for m in models]

  @nnx.jit
  def step(m0, m1, o0, o1, bad):
    for m, o, poison in ((m0, o0, bad), (m1, o1, False)):
      g = jax.tree.map(jnp.ones_like, nnx.state(m, nnx.Param))
      g["bias"][...] = g["bias"][...].at[0].set(jnp.where(poison, jnp.inf, 1))
      o.update(m, g)
    fs.sync_loss_scales(o0, o1)  # the result dropped, as NNX users do

  step(*models, *opts, True)  # optimizer 0 overflows: one back-off for both
  scales = [float(fs.current_scale(o.opt_state)) for o in opts]
  assert scales == [2.0**19, 2.0**19]
  # Outside nnx.jit too, and the optimizers themselves come back.
  out = fs.sync_loss_scales(*opts)
  assert out[0] is opts[0] and out[1] is opts[1]
  # The Variables now hold what that sync wrote: a second sync changes
  # nothing, as for plain states; after an update each, the two sync again.
  before = [bits(o.opt_state) for o in opts]
  fs.sync_loss_scales(*opts)
  assert [bits(o.opt_state) for o in opts] == before
  for m, o in zip(models, opts):
    o.update(m, jax.tree.map(jnp.ones_like, nnx.state(m, nnx.Param)))
  fs.sync_loss_scales(*opts)


# ----------------------------- 4: a second sync changes nothing


def test_a_second_sync_changes_nothing_eager_or_jitted():
  """Not refused, since harmless: a sync of what a sync returned (or of
  states that did not step) gives them back as they were."""
  tx0, tx1 = chain(), chain()
  p = jnp.ones(2)
  s0, s1 = tx0.init(p), tx1.init(p)
  _, s0 = tx0.update(jnp.array([1.0, jnp.inf]), s0, p)
  _, s1 = tx1.update(jnp.array([1.0, 2.0]), s1, p)
  s0, s1 = fs.sync_loss_scales(s0, s1)
  assert float(fs.current_scale(s0)) == float(fs.current_scale(s1)) == 512.0
  twice = jax.jit(lambda a, b: fs.sync_loss_scales(*fs.sync_loss_scales(a, b)))
  for again in (fs.sync_loss_scales(s0, s1), twice(s0, s1)):
    assert bits(again) == bits((s0, s1))
  # The states tx.update returns from a synced state sync again.
  _, s0 = tx0.update(jnp.array([1.0, 2.0]), s0, p)
  _, s1 = tx1.update(jnp.array([1.0, 2.0]), s1, p)
  fs.sync_loss_scales(s0, s1)


# ---------------------- 5: a cast audit of a checkpoint that holds an inf


def test_cast_report_counts_values_already_inf_or_nan_and_lists_them_first():
  params = {
    "a": np.array([1.0, 7e4, 2.0], np.float32),  # one past float16's range
    "b": np.array([np.inf, 1.0, np.nan, -np.inf], np.float32),
    "c": np.array([3.0], np.float32),
  }
  report = fs.cast_report(params, "float16")
  assert report.nonfinite == ("['b']",)
  assert report.leaves["['b']"].nonfinite == 3  # inf, nan, -inf: by hand
  assert report.leaves["['a']"].nonfinite == 0
  assert list(report.leaves)[0] == "['b']"  # listed first
  text = str(report)
  assert text.startswith("NOT CLEAN: 3 values are already inf or NaN")
  assert "Restore an earlier checkpoint" in text
  # A clean checkpoint's report says none of it.
  clean = str(fs.cast_report({"c": params["c"]}, "float16"))
  assert "NOT CLEAN" not in clean and "already" not in clean


def test_cast_report_inside_jit_speaks_of_a_params_tree():
  with pytest.raises(TypeError) as e:
    jax.jit(lambda p: fs.cast_report(p, "float16") and p)(jnp.ones(2))
  msg = str(e.value)
  assert "params holds tracers" in msg
  assert "fs.cast_report(params, jnp.float16)" in msg
  assert "scale_metrics" not in msg and "opt_state" not in msg


# ----------------------------- 6: tx.init on an unfiltered Equinox module


def test_init_on_an_unfiltered_equinox_module_names_eqx_filter():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.PRNGKey(0))
  tx = fs.chain(
    fs.fp16_loss_scale(fs.torch_scaler()),
    fs.clip_by_unscaled_norm(1.0),
    optax.adam(1e-3),
  )
  with pytest.raises(TypeError) as e:
    tx.init(model)
  msg = str(e.value)
  assert "not an array" in msg and "custom_jvp" in msg  # eqx's relu
  assert "eqx.filter(model, eqx.is_inexact_array)" in msg
  tx.init(eqx.filter(model, eqx.is_inexact_array))  # the fix it names
  # Given the tree (as the callers are to pass it), the path is named too.
  from fp16_scaling import _norm

  with pytest.raises(
    TypeError, match=r"leaf 4 \(\.activation\) is a custom_jvp"
  ):
    _norm.check_float_leaves(jax.tree.leaves(model), "params", tree=model)


# ------------------ 7: the report's range rows and fully non-finite leaves


def test_range_rows_put_non_finite_leaves_apart():
  tx = fs.chain(
    fs.fp16_loss_scale(fs.static_scaler(4.0), grad_range=True), optax.sgd(1)
  )
  p = {"a": jnp.ones(2), "b": jnp.ones(3), "z": jnp.ones(2)}
  grads = {
    "a": jnp.array([jnp.inf, jnp.nan]),  # no finite value at all
    "b": jnp.array([1.0, 2.0, 3.0]),
    "z": jnp.zeros(2),  # all zero: +inf headroom, rightly
  }
  _, state = tx.update(grads, tx.init(p), p)
  text = str(fs.overflow_report(state))
  rows = text[text.index("Gradient range") :].splitlines()[1:]
  # b (log2(65504 / (0.75 * 4)) = 14.4 bits) before z (inf), then a apart.
  assert rows[0].split()[-1] == "['b']" and rows[1].split()[-1] == "['z']"
  assert rows[2].startswith("  Not ranked, held an inf or NaN")
  assert rows[3].split() == ["none", "-", "0.0%", "['a']"]


# ---------- 8 (issue 48): a wrong layer axis of matching size, fair slips


def test_a_layer_axis_of_matching_size_other_than_0_warns_when_0_fits():
  """w [8, 16, 16] and b [8, 16] stacked by lax.scan on axis 0: axis=1
  gives 16 on both, so every size check passes. Axis 0 fits every stacked
  leaf too (8, which no unstacked leaf has), so the shapes cannot tell: a
  warning names axis 0. The right call (axis 0), a leaf whose axis 0
  differs, and an axis 0 that the head shares (MaxText's embed) stay
  quiet."""
  params = stacked_params()
  with pytest.warns(UserWarning) as record:
    chain(stacked_axes=fs.stacked_under("layers", axis=1)).init(params)
  (w,) = [r for r in record if "stacked_axes" in str(r.message)]
  msg = str(w.message)
  assert "layer axis 1 (size 16)" in msg and "(8)" in msg
  assert "fs.stacked_under(..., axis=0)" in msg
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    chain(stacked_axes=fs.stacked_under("layers")).init(params)
    # Axis 0 of another size on one leaf: axis 1 is the only reading.
    mixed = {"w": jnp.zeros((4, L, D)), "b": jnp.zeros((3, L))}
    mixed_tx = chain(stacked_axes={"w": 1, "b": 1})
    mixed_tx.init(mixed)
    # MaxText's [embed, layers, mlp] (docs/stacked.md): axis 0 fits every
    # stacked leaf, but the head has its size: a model width, not layers.
    maxtext = {
      "layers": {"wi": jnp.zeros((D, L, D)), "scale": jnp.zeros((D, L))},
      "head": jnp.zeros((D, 1)),
    }
    chain(stacked_axes=fs.stacked_under("layers", axis=1)).init(maxtext)
  assert mixed_tx.config.scale.layout(mixed).axes == (1, 1)  # b, w


@pytest.mark.parametrize(
  "spec, fix",
  [
    ("", "key=dtype parts such as 'p=f32,c=f16,o=f32'"),
    ("compute:float16", "write 'compute=float16'"),
  ],
)
def test_get_policy_of_a_whole_spec_that_is_no_dtype_names_key_equals(
  spec, fix
):
  with pytest.raises(ValueError) as e:
    fs.get_policy(spec)
  assert "unknown dtype" in str(e.value) and fix in str(e.value)
  assert "the keys are p, params, c, compute, o, output" in str(e.value)
  assert fs.get_policy("compute=float16").compute_dtype == jnp.float16


def test_float32_takes_keep_dtype_by_position_too():
  """``fs.float32(fn, True)`` is ``fs.float32(fn, keep_dtype=True)``."""
  x = jnp.ones(2, jnp.float16)
  assert fs.float32(lambda v: v * 2, True)(x).dtype == jnp.float16
  assert fs.float32(lambda v: v * 2)(x).dtype == jnp.float32
  with pytest.raises(TypeError, match="keep_dtype must be True or False"):
    fs.float32(lambda v: v, 1)


@pytest.mark.parametrize(
  "preset, first",
  [(fs.jmp_scaler, "loss_scale"), (fs.keras_scaler, "initial_scale")],
)
def test_a_jax_preset_given_a_positional_argument_names_its_keyword(
  preset, first
):
  """Presets take keywords only (docs/peers.md); jmp's
  ``DynamicLossScale(2.0**15)`` habit gets a message naming the keyword,
  and the signature stays keyword-only for introspection."""
  import inspect

  with pytest.raises(TypeError) as e:
    preset(2.0**15)
  msg = str(e.value)
  assert f"{preset.__name__}({first}=32768.0)" in msg
  assert "takes keyword arguments only" in msg
  params = inspect.signature(preset).parameters.values()
  assert all(p.kind is p.KEYWORD_ONLY for p in params)
  assert preset(**{first: 2.0**14}).init_scale == 2.0**14


def test_another_librarys_scaler_object_names_its_twin_preset():
  jmp = pytest.importorskip("jmp")
  with pytest.raises(TypeError) as e:
    fs.fp16_loss_scale(jmp.DynamicLossScale(jnp.float32(2.0**15)))
  msg = str(e.value)
  assert "got DynamicLossScale" in msg and "fs.jmp_scaler(loss_scale=" in msg
  assert "fs.load_scaler_state_dict" in msg
  with pytest.raises(TypeError, match="got float$"):
    fs.fp16_loss_scale(2.0**15)  # no twin to name: the message as before


def test_accumulate_gradients_first_in_fs_chain_says_it_goes_outside():
  inner = chain()
  with pytest.raises(ValueError) as e:
    fs.chain(fs.accumulate_gradients(inner, 2), optax.sgd(0.1))
  msg = str(e.value)
  assert "got an fs.accumulate_gradients" in msg
  assert "goes outside, around the whole chain" in msg
  assert "fs.accumulate_gradients(fs.chain(fs.fp16_loss_scale(" in msg
  with pytest.raises(ValueError) as e:
    fs.chain(optax.sgd(0.1))
  assert "goes outside" not in str(e.value)
