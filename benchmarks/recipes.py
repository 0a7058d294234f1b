"""The optimizer steps that the benchmarks compare, and their inputs.

Every recipe takes the same float16 gradients (already multiplied by the
loss scale where it has one) and float32 parameters, clips at a global norm
of 1.0, runs AdamW and applies the updates (``RECIPES``, a to e, b's
options ``OPTIONS``, f to j, and the flat forms ``FLAT``, k and l;
benchmarks/README.md lists them); ``MORE``'s two, m and n, leave out the
clip, for gpu_kernels.py. No timer
here: ``build(key, num_leaves)`` returns ``(init, step)``, ``jitted`` the
same with the step jitted, its parameters and state donated.
"""

import dataclasses
import functools

LR = 1e-3
WEIGHT_DECAY = 1e-4
MAX_NORM = 1.0
LOSS_SCALE = 2.0**16  # the initial (or static) scale of every scaled recipe
ACCUMULATE_K = 4  # microbatches per window of recipe j


@dataclasses.dataclass(frozen=True)
class Recipe:
  key: str
  label: str
  module: str  # the third-party package it needs ("" for none)
  calls: int = 1  # calls that make one unit of work (a window for j)


RECIPES = (
  Recipe("floor", "a. optax clip + adamw, no scaling (floor)", ""),
  Recipe("fp16", "b. fp16_scaling", ""),
  Recipe("fp16_expert", "b. fp16_scaling, expert mask", ""),
  Recipe("jmp", "c. jmp DynamicLossScale + select_tree", "jmp"),
  Recipe("apply_if_finite", "d. optax.apply_if_finite, static scale", ""),
  Recipe("flax", "e. flax DynamicScale + jnp.where", "flax"),
)
# b's options. Not in the default set: ``--recipes options`` selects them.
OPTIONS = (
  Recipe("grad_range", "f. b + grad_range=True", ""),
  Recipe("log_overflows", "g. b + log_overflows=True", ""),
  Recipe("headroom", "h. b with headroom_scaler()", ""),
  Recipe("accumulate1", "i. accumulate_gradients(b, 1)", ""),
  Recipe(
    "accumulate4",
    f"j. accumulate_gradients(b, {ACCUMULATE_K}), mean call of a window",
    "",
    calls=ACCUMULATE_K,
  ),
)
# The flat forms: the optimizer on one vector of all parameters
# (``optax.flatten``), so that a step runs a few kernels over every
# parameter instead of a few per leaf. ``--recipes flat`` selects them.
FLAT = (
  Recipe("flat_floor", "k. optax.flatten(clip + adamw), no scaling", ""),
  Recipe("flat_fp16", "l. fs.chain(scale, clip, optax.flatten(adamw))", ""),
)
# Two more for gpu_kernels.py's kernel counts: the optimizer alone (one
# update kernel a leaf), and b without its clip.
MORE = (
  Recipe("adamw", "m. optax.adamw alone: no clip, no scaling", ""),
  Recipe("fp16_noclip", "n. fs.chain(fp16_loss_scale, adamw): b, no clip", ""),
)
BY_KEY = {r.key: r for r in RECIPES + OPTIONS + FLAT + MORE}
OVERFLOW_ROW = "b. fp16_scaling, overflow step"


def leaf_sizes(n, leaves, distinct=False):
  """``leaves`` sizes that sum to ``n``: equal (the first takes the
  remainder), or with ``distinct`` each one element larger than the one
  before, around the same mean (the last takes the remainder), so that no
  two leaves share a shape: XLA:CPU compiles one kernel for all the fusions
  alike, leaves of one shape included, and a real model has many shapes."""
  base = n // leaves
  if not distinct:
    sizes = [base] * leaves
    sizes[0] += n - sum(sizes)
    return sizes
  if base <= leaves:
    raise ValueError(
      f"distinct sizes need more than {leaves} params a leaf, got {base}"
    )
  sizes = [base + i - leaves // 2 for i in range(leaves)]
  sizes[-1] += n - sum(sizes)  # the largest: it stays the only one its size
  return sizes


def fp16_tx(
  num_leaves,
  expert=False,
  headroom=False,
  flat=False,
  clip=True,
  **scale_kwargs,
):
  """Recipe b: ``fs.chain(fp16_loss_scale, clip_by_unscaled_norm, adamw)``;
  ``flat``: adamw as ``optax.flatten(adamw)`` (recipe l); not ``clip``:
  no clip (recipe n)."""
  import optax

  import fp16_scaling as fs

  mask = [i % 2 == 1 for i in range(num_leaves)] if expert else None
  preset = fs.headroom_scaler if headroom else fs.deepspeed_scaler
  adamw = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  clipping = [fs.clip_by_unscaled_norm(MAX_NORM, expert_mask=mask)]
  return fs.chain(
    fs.fp16_loss_scale(preset(init_scale=LOSS_SCALE), **scale_kwargs),
    *(clipping if clip else []),
    optax.flatten(adamw) if flat else adamw,
  )


def clip_adamw():
  """The optimizer of every recipe: ``chain(clip_by_global_norm, adamw)``."""
  import optax

  return optax.chain(
    optax.clip_by_global_norm(MAX_NORM),
    optax.adamw(LR, weight_decay=WEIGHT_DECAY),
  )


def to_f32(grads):
  """``grads`` cast to float32, as plain optax's recipes take them."""
  import jax
  import jax.numpy as jnp

  return jax.tree.map(lambda g: g.astype(jnp.float32), grads)


def stepping(tx, prepare=lambda g: g):
  """``(tx.init, step)``: the step runs ``tx`` on ``prepare(grads)`` and
  applies the updates."""
  import optax

  def step(params, state, grads):
    updates, state = tx.update(prepare(grads), state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step


def build(key, num_leaves):
  """``(init(params) -> state, step(params, state, grads) -> (params,
  state))`` of recipe ``key``, not jitted."""
  import jax
  import jax.numpy as jnp
  import optax

  f32 = jnp.float32
  plain = stepping

  if key == "floor":
    return plain(clip_adamw(), to_f32)

  if key in ("fp16", "fp16_expert"):
    return plain(fp16_tx(num_leaves, expert=key == "fp16_expert"))

  if key == "adamw":
    return plain(optax.adamw(LR, weight_decay=WEIGHT_DECAY), to_f32)

  if key == "fp16_noclip":
    return plain(fp16_tx(num_leaves, clip=False))

  if key == "flat_floor":
    return plain(optax.flatten(clip_adamw()), to_f32)

  if key == "flat_fp16":
    return plain(fp16_tx(num_leaves, flat=True))

  if key in ("grad_range", "log_overflows", "headroom"):
    return plain(fp16_tx(num_leaves, **{key: True}))

  if key in ("accumulate1", "accumulate4"):
    import fp16_scaling as fs

    k = 1 if key == "accumulate1" else ACCUMULATE_K
    return plain(fs.accumulate_gradients(fp16_tx(num_leaves), k))

  if key == "jmp":
    import jmp

    tx = clip_adamw()

    # The loss scale travels as its two arrays: jmp's DynamicLossScale pytree
    # validates its leaves on unflatten and so cannot be an argument of
    # ``jit(...).lower`` in current JAX; it is rebuilt inside the step.
    def init(params):
      scale = jnp.asarray(LOSS_SCALE, f32)
      return tx.init(params), (scale, jnp.zeros([], jnp.int32))

    def step(params, state, grads):
      opt_state, (scale, counter) = state
      loss_scale = jmp.DynamicLossScale(scale, counter)
      grads = loss_scale.unscale(to_f32(grads))  # cast_to_param, then unscale
      grads_finite = jmp.all_finite(grads)
      loss_scale = loss_scale.adjust(grads_finite)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      params, opt_state = jmp.select_tree(
        grads_finite, (new_params, new_opt_state), (params, opt_state)
      )
      return params, (opt_state, (loss_scale.loss_scale, loss_scale.counter))

    return init, step

  if key == "apply_if_finite":
    inv_scale = 1.0 / LOSS_SCALE
    return plain(
      optax.apply_if_finite(clip_adamw(), max_consecutive_errors=5),
      lambda grads: jax.tree.map(lambda g: g.astype(f32) * inv_scale, grads),
    )

  if key == "flax":
    from flax.training.dynamic_scale import DynamicScale

    tx = clip_adamw()

    # DynamicScale.value_and_grad differentiates ``scale * loss``. Its
    # backward pass here hands back the precomputed (already scaled) float16
    # gradients, so everything DynamicScale does to them afterwards (float32
    # cast, unscale, all-finite check, scale update) runs as written.
    @jax.custom_vjp
    def present(g):
      del g
      return jnp.zeros([], f32)

    present.defvjp(lambda g: (jnp.zeros([], f32), g), lambda g, ct: (g,))

    def init(params):
      return tx.init(params), DynamicScale(
        fin_steps=jnp.zeros([], jnp.int32), scale=jnp.asarray(LOSS_SCALE, f32)
      )

    def step(params, state, grads):
      opt_state, dynamic_scale = state
      dynamic_scale, is_fin, _, grads = dynamic_scale.value_and_grad(present)(
        grads
      )
      updates, new_opt_state = tx.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      select = functools.partial(jnp.where, is_fin)  # as Flax's examples do
      params = jax.tree.map(select, new_params, params)
      opt_state = jax.tree.map(select, new_opt_state, opt_state)
      return params, (opt_state, dynamic_scale)

    return init, step

  raise KeyError(key)


def jitted(key, num_leaves, compiler_options=None):
  """``build``'s pair with the step jitted, params and state donated;
  ``compiler_options``: XLA options its compile gets (``jax.jit``'s), none
  for XLA's defaults."""
  import jax

  init, step = build(key, num_leaves)
  return init, jax.jit(
    step, donate_argnums=(0, 1), compiler_options=compiler_options or None
  )


def make_inputs(n, num_leaves, seed=0, distinct=False):
  """float32 params and two float16 gradient trees: clean and one inf;
  ``distinct``: leaf sizes as :func:`leaf_sizes` spreads them.

  Drawn with numpy and copied to the device: ``jax.random`` would compile a
  sampler for every leaf shape (minutes for 200 distinct sizes), and the
  values matter to no measurement.
  """
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  sizes = leaf_sizes(n, num_leaves, distinct)
  params = [
    jnp.asarray(0.02 * rng.standard_normal(s, np.float32)) for s in sizes
  ]
  draws = [rng.standard_normal(s, np.float32).astype(np.float16) for s in sizes]
  grads = [jnp.asarray(g) for g in draws]
  draws[0][0] = np.inf
  overflow = [jnp.asarray(draws[0])] + grads[1:]
  return params, grads, overflow


def abstract_inputs(n, num_leaves, distinct=False):
  """The shapes and dtypes of :func:`make_inputs`'s params and gradients
  (``jax.ShapeDtypeStruct``): what a compile needs, with no array drawn."""
  import jax
  import jax.numpy as jnp

  sizes = leaf_sizes(n, num_leaves, distinct)
  params = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]
  return params, [jax.ShapeDtypeStruct((s,), jnp.float16) for s in sizes]


def copy_tree(tree):
  """Distinct buffers: an init may return one array in two leaves, which
  cannot be donated twice."""
  import jax
  import jax.numpy as jnp

  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
