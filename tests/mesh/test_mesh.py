"""Global norm and overflow across device meshes: one device, jit over a mesh,
shard_map.

Two layouts, each leaf with a PartitionSpec: a data x expert mesh (4x2) and a
data x expert x model mesh (2x2x2) with tensor-parallel leaves. The same
optimizer, built with those partition_specs, runs
  * on one device, on the global gradients;
  * under jit over the mesh, on NamedSharding-placed global gradients;
  * under shard_map, where each device holds only its blocks (check_vma on and
    off).
The 12-step run has natural overflows (the initial scale is too high), an inf in
one element of one expert's gradient shard that exactly one device holds, and a
step whose float32 squares overflow (the rescue branch, whose collectives run
inside lax.cond). Every mode is checked against a reference that shares no code
with fp16_scaling: numpy norms of the global gradients, a plain-Python torch.amp
scale rule, and optax's clip_by_global_norm + adam on the clean steps only.
"""

from typing import Any, NamedTuple

from helpers import guarded
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import fp16_scaling as fs

STEPS = 12
INJECT_STEP = 6  # one element of one expert shard is inf on this step
# A float32 leaf with finite elements whose squares overflow float32.
RESCUE_STEP = 9
INIT_SCALE = 2.0**17
GROWTH_INTERVAL = 3
MAX_NORM = 1.0
LR = 1e-2
STD = 0.25
KEYS = ("prev_loss_scale", "loss_scale", "overflow", "skipped_steps")
KEYS += ("grad_norm", "expert_grad_norm", "shared_grad_norm")


class Layout(NamedTuple):
  name: str
  mesh_shape: tuple
  axis_names: tuple
  shapes: dict  # nested dict: leaf -> shape
  specs: Any  # a prefix of the params' structure, as a user gives shard_map
  # path of the one leaf whose gradient is float32 (the others are float16)
  f32_leaf: tuple
  inject: tuple  # (path, index) of the inf on INJECT_STEP


DATA_EXPERT = Layout(
  name="data4_expert2",
  mesh_shape=(4, 2),
  axis_names=("data", "expert"),
  shapes={
    "shared": {"embed": (8, 16), "head": (16, 4)},
    "zero": (16,),
    "expert": {"w_in": (4, 16, 8), "w_out": (4, 8, 16)},
  },
  specs={
    "shared": P(),  # one spec for the subtree: replicated on every device
    "zero": P("data"),  # a shared leaf split over data (ZeRO-style)
    "expert": {"w_in": P("expert"), "w_out": P("expert", None, "data")},
  },
  f32_leaf=("shared", "head"),
  # expert 3 -> expert shard 1; column 15 -> data shard 3
  inject=(("expert", "w_out"), (3, 0, 15)),
)

DATA_EXPERT_MODEL = Layout(
  name="data2_expert2_model2",
  mesh_shape=(2, 2, 2),
  axis_names=("data", "expert", "model"),
  shapes={
    "shared": {"embed": (8, 16), "head": (16, 4)},
    "bias": (16,),
    "zero": (16,),
    "expert": {"w_in": (4, 16, 8), "w_out": (4, 8, 16)},
  },
  specs={
    "shared": {
      "embed": P(None, "model"),
      "head": P("model", None),
    },  # tensor parallel
    "bias": P(),
    "zero": P(("data", "model")),
    "expert": {
      "w_in": P("expert", None, "model"),
      "w_out": P("expert", "model", "data"),
    },
  },
  f32_leaf=("shared", "head"),
  # expert shard 1, model shard 1, data shard 0
  inject=(("expert", "w_out"), (2, 7, 0)),
)

LAYOUTS = [DATA_EXPERT, DATA_EXPERT_MODEL]


# ------------------------------------------------------------------------------
# Trees and data.


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _paths(tree, prefix=()):
  if isinstance(tree, dict):
    return [p for k in sorted(tree) for p in _paths(tree[k], prefix + (k,))]
  return [prefix]


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def full_specs(layout):
  """The prefix specs broadcast to one PartitionSpec per leaf."""
  return jax.tree.map(
    lambda spec, sub: jax.tree.map(lambda _: spec, sub, is_leaf=_is_shape),
    layout.specs,
    layout.shapes,
    is_leaf=lambda s: isinstance(s, P),
  )


def expert_mask(layout):
  return {
    k: jax.tree.map(lambda _: k == "expert", v, is_leaf=_is_shape)
    for k, v in layout.shapes.items()
  }


def init_params(layout):
  rng = np.random.default_rng(7)
  return jax.tree.map(
    lambda s: rng.standard_normal(s).astype(np.float32),
    layout.shapes,
    is_leaf=_is_shape,
  )


def scaled_grads(layout, step, scale):
  """What a float16 backward pass at `scale` hands the optimizer on `step`
  (numpy,
  global arrays).
  """
  rng = np.random.default_rng(100 + step)
  out = {}
  for path in _paths(layout.shapes):
    g = rng.standard_normal(_get(layout.shapes, path)).astype(
      np.float32
    ) * np.float32(STD)
    f32 = path == layout.f32_leaf
    if step == RESCUE_STEP:
      g = g * np.float32(1e-3)
    with np.errstate(over="ignore"):
      x = (g * np.float32(scale)).astype(np.float32 if f32 else np.float16)
    if step == RESCUE_STEP and f32:
      x.flat[:3] = np.float32(1e20)  # finite, but 1e40 is not a float32
    if step == INJECT_STEP and path == layout.inject[0]:
      x[layout.inject[1]] = np.inf
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = x
  return out


def grads_at(layout, step, state):
  """:func:`scaled_grads` at ``state``'s current scale."""
  return scaled_grads(layout, step, float(fs.current_scale(state)))


def make_tx(layout, partition_specs="layout"):
  specs = layout.specs if partition_specs == "layout" else partition_specs
  return guarded(
    fs.torch_scaler(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL),
    fs.clip_by_unscaled_norm(
      MAX_NORM,
      expert_mask=expert_mask(layout),
      eps=0.0,
    ),
    optax.adam(LR),
    partition_specs=specs,
  )


def state_specs(tx, layout, params, specs=None):
  """The optimizer state's PartitionSpecs: Adam's moments like the params,
  scalars
  replicated.
  """
  return optax.tree_map_params(
    tx,
    lambda _, spec: spec,
    tx.init(params),
    full_specs(layout) if specs is None else specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda s: isinstance(s, P),
  )


def make_mesh(layout, axis_type=AxisType.Explicit):
  return jax.make_mesh(
    layout.mesh_shape,
    layout.axis_names,
    axis_types=(axis_type,) * len(layout.axis_names),
  )


def place(tree, specs, mesh):
  """device_put with the specs padded to each array's rank, as jit's outputs
  spell
  them.
  """

  def put(x, spec):
    return jax.device_put(
      x, NamedSharding(mesh, P(*spec, *[None] * (np.ndim(x) - len(spec))))
    )

  return jax.tree.map(put, tree, specs, is_leaf=lambda s: isinstance(s, P))


def placed(tx, layout, mesh, state_tx=None):
  """``(specs, state specs, params, state)``: the layout's parameters and
  ``state_tx``'s (default ``tx``) first state, placed on ``mesh``."""
  state_tx = state_tx or tx
  specs = full_specs(layout)
  st_specs = state_specs(state_tx, layout, init_params(layout))
  params = place(init_params(layout), specs, mesh)
  state = place(state_tx.init(init_params(layout)), st_specs, mesh)
  return specs, st_specs, params, state


def step_fn(tx):
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _record(metrics, params):
  rec = {k: np.asarray(metrics[k]).item() for k in KEYS}
  rec["params"] = jax.tree.map(np.asarray, params)
  return rec


# ------------------------------------------------------------------------------
# The reference (no fp16_scaling code) and the three ways of running
# fp16_scaling.


def reference_run(layout):
  opt = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(LR))
  update = jax.jit(opt.update)
  params = init_params(layout)
  opt_state = opt.init(params)
  scale, tracker, skipped, history = INIT_SCALE, 0, 0, []
  mask = expert_mask(layout)
  for t in range(STEPS):
    grads = scaled_grads(layout, t, scale)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    overflow = not all(np.isfinite(x).all() for x in leaves)
    sq = [float(np.sum(x * x)) for x in leaves]
    is_expert = jax.tree.leaves(mask)
    rec = {
      "prev_loss_scale": scale,
      "overflow": overflow,
      "grad_norm": np.sqrt(sum(sq)) / scale,
      "expert_grad_norm": np.sqrt(sum(s for s, e in zip(sq, is_expert) if e))
      / scale,
      "shared_grad_norm": np.sqrt(
        sum(s for s, e in zip(sq, is_expert) if not e)
      )
      / scale,
    }
    if not overflow:
      unscaled = jax.tree.map(
        lambda x: x.astype(np.float32) / np.float32(scale), grads
      )
      updates, opt_state = update(unscaled, opt_state, params)
      params = jax.tree.map(np.asarray, optax.apply_updates(params, updates))
    # torch.amp.GradScaler's rule.
    skipped += overflow
    if overflow:
      scale, tracker = scale * 0.5, 0
    else:
      tracker += 1
      if tracker == GROWTH_INTERVAL:
        scale, tracker = scale * 2.0, 0
    rec.update(loss_scale=scale, skipped_steps=skipped, params=params)
    history.append(rec)
  return history


def single_device_run(layout):
  tx = make_tx(layout)
  step = jax.jit(step_fn(tx))
  dev = jax.devices()[0]
  params = jax.device_put(init_params(layout), dev)
  state = jax.device_put(tx.init(params), dev)
  history = []
  for t in range(STEPS):
    grads = jax.device_put(grads_at(layout, t, state), dev)
    params, state = step(grads, state, params)
    history.append(_record(fs.scale_metrics(state), params))
  return history


def jit_mesh_run(layout):
  tx = make_tx(layout)
  mesh = make_mesh(layout)
  with jax.set_mesh(mesh):
    step = jax.jit(step_fn(tx))
    specs, _, params, state = placed(tx, layout, mesh)
    before = jax.tree.map(lambda x: x.sharding, (params, state))
    history = []
    for t in range(STEPS):
      grads = place(grads_at(layout, t, state), specs, mesh)
      params, state = step(grads, state, params)
      assert jax.tree.map(lambda x: x.sharding, (params, state)) == before, (
        f"step {t}"
      )
      history.append(_record(fs.scale_metrics(state), params))
  return history


def shard_map_run(layout, check_vma):
  """Each device sees its blocks; it also reports its own view of the step's
  outcome.
  """
  tx = make_tx(layout)
  mesh = make_mesh(layout)
  specs, st_specs, params, state = placed(tx, layout, mesh)
  step = step_fn(tx)

  def local_step(grads, state, params):
    params, state = step(grads, state, params)
    metrics = fs.scale_metrics(state)
    mine = jnp.stack([jnp.asarray(metrics[k], jnp.float32) for k in KEYS])[None]
    return params, state, mine

  sharded_step = jax.jit(
    jax.shard_map(
      local_step,
      mesh=mesh,
      in_specs=(layout.specs, st_specs, layout.specs),
      out_specs=(layout.specs, st_specs, P(layout.axis_names)),
      check_vma=check_vma,
    )
  )
  with jax.set_mesh(mesh):
    history = []
    for t in range(STEPS):
      global_grads = grads_at(layout, t, state)
      grads = place(global_grads, specs, mesh)
      if t == INJECT_STEP:  # the inf is held by exactly one device
        shards = _get(grads, layout.inject[0]).addressable_shards
        finite = [np.isfinite(np.asarray(s.data)).all() for s in shards]
        assert finite.count(False) == 1
      params, state, per_device = sharded_step(grads, state, params)
      rec = _record(fs.scale_metrics(state), params)
      rec["per_device"] = np.asarray(per_device)
      history.append(rec)
  return history


# ------------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda l: l.name)
def layout(request):
  return request.param


@pytest.fixture(scope="module")
def reference(layout):
  return reference_run(layout)


def test_reference_covers_the_cases(layout, reference):
  """The run exercises what the module docstring says, so the other tests can
  fail.
  """
  overflows = [r["overflow"] for r in reference]
  assert overflows[0] and sum(overflows) >= 3
  clean_at_inject = scaled_grads(
    layout, INJECT_STEP, reference[INJECT_STEP]["prev_loss_scale"]
  )
  _get(clean_at_inject, layout.inject[0])[layout.inject[1]] = 0
  assert overflows[INJECT_STEP] and all(
    np.isfinite(x).all() for x in jax.tree.leaves(clean_at_inject)
  )
  assert not overflows[RESCUE_STEP]
  f32 = _get(
    scaled_grads(
      layout, RESCUE_STEP, reference[RESCUE_STEP]["prev_loss_scale"]
    ),
    layout.f32_leaf,
  )
  with np.errstate(over="ignore"):
    assert np.isinf(np.sum(f32 * f32, dtype=np.float32))
  assert any(
    r["loss_scale"] > r["prev_loss_scale"] for r in reference
  )  # a growth
  assert any(
    r["grad_norm"] > MAX_NORM for r in reference if not r["overflow"]
  )  # clipping is active


def check_against_reference(history, reference):
  for t, (got, want) in enumerate(zip(history, reference)):
    msg = f"step {t}"
    assert got["overflow"] == want["overflow"], msg
    assert got["prev_loss_scale"] == want["prev_loss_scale"], msg  # bit-exact
    assert got["loss_scale"] == want["loss_scale"], msg
    assert got["skipped_steps"] == want["skipped_steps"], msg
    for k in ("grad_norm", "expert_grad_norm", "shared_grad_norm"):
      # A norm over a non-finite leaf does not exist: reported as 0.0. A
      # group that stayed finite on an overflow step reports its true norm.
      expected = want[k] if np.isfinite(want[k]) else 0.0
      np.testing.assert_allclose(
        got[k], expected, rtol=1e-5, err_msg=f"{msg} {k}"
      )
    for g, w in zip(
      jax.tree.leaves(got["params"]), jax.tree.leaves(want["params"])
    ):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=msg)
    if want["overflow"] and t > 0:  # skipped exactly: bit-identical parameters
      for g, prev in zip(
        jax.tree.leaves(got["params"]),
        jax.tree.leaves(history[t - 1]["params"]),
      ):
        np.testing.assert_array_equal(g, prev, err_msg=msg)


@pytest.fixture(scope="module")
def single(layout):
  return single_device_run(layout)


def test_single_device_matches_reference(single, reference):
  check_against_reference(single, reference)


def check_against_single(t, got, one):
  for k in KEYS:
    np.testing.assert_allclose(
      got[k], one[k], rtol=1e-6, err_msg=f"step {t} {k}"
    )
  for g, w in zip(
    jax.tree.leaves(got["params"]), jax.tree.leaves(one["params"])
  ):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def test_jit_over_mesh_matches_reference_and_single_device(
  layout, single, reference
):
  """Explicit mesh axes; every step also keeps every parameter's and state
  leaf's
  sharding.
  """
  history = jit_mesh_run(layout)
  check_against_reference(history, reference)
  for t, (got, one) in enumerate(zip(history, single)):
    check_against_single(t, got, one)


@pytest.mark.parametrize(
  "check_vma", [True, False], ids=["check_vma", "no_check_vma"]
)
def test_shard_map_matches_reference_and_single_device(
  layout, single, reference, check_vma
):
  history = shard_map_run(layout, check_vma)
  check_against_reference(history, reference)
  for t, (got, one) in enumerate(zip(history, single)):
    check_against_single(t, got, one)
    # Every device took the same decision and ends the step with the same scale,
    # counters and norms: one inf on one device made all eight skip.
    per_device = got["per_device"]
    assert per_device.shape == (8, len(KEYS))
    np.testing.assert_array_equal(
      per_device,
      np.broadcast_to(per_device[:1], per_device.shape),
      err_msg=f"step {t}: devices disagree",
    )
    want = [got[k] for k in KEYS]
    np.testing.assert_array_equal(
      per_device[0], np.asarray(want, np.float32), err_msg=f"step {t}"
    )
  assert history[INJECT_STEP]["per_device"][:, KEYS.index("overflow")].all()


def test_jit_update_keeps_state_shardings(layout):
  """NamedSharding in, shardings left to the compiler's propagation (Auto axes,
  where nothing in the types pins them): the state comes back sharded as it went
  in. (Explicit axes: jit_mesh_run.)
  """
  tx = make_tx(layout)
  mesh = make_mesh(layout, AxisType.Auto)
  specs, st_specs, params, state = placed(tx, layout, mesh)

  def shardings(sp):
    return jax.tree.map(
      lambda s: NamedSharding(mesh, s), sp, is_leaf=lambda s: isinstance(s, P)
    )

  with jax.set_mesh(mesh):
    step = jax.jit(
      step_fn(tx),
      in_shardings=(shardings(specs), shardings(st_specs), shardings(specs)),
    )
    before = jax.tree.map(lambda x: x.sharding, (params, state))
    # Overflow, rescue, plain.
    for t in (INJECT_STEP, RESCUE_STEP, RESCUE_STEP + 1):
      grads = place(grads_at(layout, t, state), specs, mesh)
      with jax.transfer_guard("disallow"):  # no host round-trip inside the step
        params, state = step(grads, state, params)
      after = jax.tree.map(lambda x: x.sharding, (params, state))
      for b, a, x in zip(
        jax.tree.leaves(before),
        jax.tree.leaves(after),
        jax.tree.leaves((params, state)),
      ):
        assert a.is_equivalent_to(b, x.ndim), f"step {t}: {b} became {a}"
  # Adam's moments really are split (the comparison above is not between
  # replicated shardings).
  mu = _get(state[2][0].mu, layout.inject[0])
  assert mu.sharding.spec == _get(specs, layout.inject[0])
  assert len(mu.addressable_shards[0].data.shape) == 3
  assert mu.addressable_shards[0].data.size < mu.size


# ------------------------------------------------------------------------------
# Bad partition specs.


def _shard_map_update(
  layout, tx, check_vma=True, grads_hook=None, state_tx=None
):
  """Traces one shard_map'd update of `tx` (built with any specs) with correct
  in/out specs, on the state `state_tx` (default: built with the layout's
  specs) makes.
  """
  mesh = make_mesh(layout)
  state_tx = state_tx or make_tx(layout)
  specs, st_specs, params, state = placed(tx, layout, mesh, state_tx)
  hook = grads_hook or (lambda g: g)
  fn = jax.shard_map(
    lambda grads, *rest: step_fn(tx)(hook(grads), *rest),
    mesh=mesh,
    in_specs=(layout.specs, st_specs, layout.specs),
    out_specs=(layout.specs, st_specs),
    check_vma=check_vma,
  )
  with jax.set_mesh(mesh):
    grads = place(scaled_grads(layout, 1, 1.0), specs, mesh)
    return jax.eval_shape(fn, grads, state, params)


def test_specs_with_wrong_structure_are_refused():
  layout = DATA_EXPERT
  wrong = {"shared": P(), "expert": P("expert")}  # no entry for "zero"
  for name, tx in [
    (
      "fp16_loss_scale",
      fs.chain(fs.fp16_loss_scale(fs.torch_scaler(), partition_specs=wrong)),
    ),
    (
      "clip_by_unscaled_norm",
      fs.clip_by_unscaled_norm(1.0, partition_specs=wrong),
    ),
  ]:
    with pytest.raises(
      ValueError, match=f"{name}: partition_specs must have the structure"
    ):
      tx.init(init_params(layout))
  # At update, given a state built with the right specs (placed on the
  # mesh), the state's treedef records those specs: the update refuses it
  # as another configuration's before it reads anything with its own.
  with pytest.raises(
    ValueError, match="this state was built with other partition_specs"
  ):
    _shard_map_update(layout, make_tx(layout, wrong))
  with pytest.raises(
    TypeError, match="partition_specs must hold a jax.sharding.PartitionSpec"
  ):
    make_tx(layout, {"shared": "data", "zero": P(), "expert": P()}).init(
      init_params(layout)
    )


def test_spec_naming_an_axis_the_mesh_lacks_is_refused():
  layout = DATA_EXPERT
  typo = {
    **layout.specs,
    "expert": {"w_in": P("experts"), "w_out": P("expert", None, "data")},
  }
  # The step's measurement reads its specs under shard_map and names the
  # axis the mesh lacks (the state, built outside the mesh by the same
  # chain, could not); so does a clip of its own, below. A state built with
  # the right specs is refused before: another configuration's.
  tx = make_tx(layout, typo)
  with pytest.raises(
    ValueError, match="names mesh axis 'experts'; the mesh has axes"
  ):
    _shard_map_update(layout, tx, state_tx=tx)
  with pytest.raises(ValueError, match="built with other partition_specs"):
    _shard_map_update(layout, tx)
  # A clip of its own (not right after the scale, where it has no specs of
  # its own) reads its specs under shard_map, and names the missing axis.
  clip = fs.clip_by_unscaled_norm(1.0, partition_specs=typo)
  mesh = make_mesh(layout)
  fn = jax.shard_map(
    lambda g: clip.update(g, clip.init(g))[0],
    mesh=mesh,
    in_specs=(layout.specs,),
    out_specs=layout.specs,
  )
  with jax.set_mesh(mesh):
    grads = place(scaled_grads(layout, 1, 1.0), full_specs(layout), mesh)
    with pytest.raises(
      ValueError, match="clip_by_unscaled_norm: partition_specs .* 'experts'"
    ):
      jax.eval_shape(fn, grads)


def test_leaf_varying_over_an_axis_its_spec_replicates_is_refused():
  """Gradients not yet averaged over data, but specs saying they are replicated
  there.
  """
  layout = DATA_EXPERT

  def per_device(grads):
    i = jax.lax.axis_index("data").astype(jnp.float16)
    return {
      **grads,
      "shared": jax.tree.map(
        lambda g: g * (i + 1).astype(g.dtype), grads["shared"]
      ),
    }

  with pytest.raises(
    ValueError,
    match=r"fp16_loss_scale: partition_specs give gradient leaf "
    r"\['shared'\]\['embed'\].*varies over that axis.*'data'",
  ):
    _shard_map_update(layout, make_tx(layout), grads_hook=per_device)


@pytest.mark.parametrize("varying", [("f16",), ("f32",), ("f16", "f32")])
def test_device_varying_gradients_without_partition_specs_are_named(varying):
  """D2: under shard_map, float16 and float32 gradients split over "data"
  and a chain built without partition_specs: the error is the library's,
  naming the leaf, the axis and partition_specs (it used to be JAX's,
  about lax.cond branches or out_specs)."""
  mesh = make_mesh(DATA_EXPERT)
  tx = fs.chain(
    fs.fp16_loss_scale(fs.torch_scaler()),
    fs.clip_by_unscaled_norm(MAX_NORM),
    optax.adam(LR),
  )
  params = {
    "f16": np.ones((8, 4), np.float32),
    "f32": np.ones((8, 4), np.float32),
  }
  specs = {k: P("data") if k in varying else P() for k in params}
  st_specs = state_specs(tx, None, params, specs)  # Adam's moments like params
  fn = jax.shard_map(
    step_fn(tx),
    mesh=mesh,
    in_specs=(specs, st_specs, specs),
    out_specs=(specs, st_specs),
  )
  grads = {"f16": jnp.ones((8, 4), jnp.float16), "f32": jnp.ones((8, 4))}
  first = varying[0]  # in tree order
  with jax.set_mesh(mesh):
    args = (
      place(grads, specs, mesh),
      place(tx.init(params), st_specs, mesh),
      place(params, specs, mesh),
    )
    with pytest.raises(
      ValueError,
      match=rf"^fp16_loss_scale: under shard_map, gradient leaf \['{first}'\] "
      r"varies over mesh axis 'data', and no partition_specs were given.*"
      r"Pass partition_specs=",
    ):
      jax.eval_shape(fn, *args)


def test_same_optimizer_without_a_mesh():
  """partition_specs are inert outside shard_map: plain jit on one device needs
  no
  mesh axis.
  """
  layout = DATA_EXPERT
  tx = make_tx(layout)
  params = init_params(layout)
  _, state = jax.jit(step_fn(tx))(
    scaled_grads(layout, 1, INIT_SCALE / 2), tx.init(params), params
  )
  assert not bool(state[0].overflow)
