"""What ``fs.sync_loss_scales`` adds to a step of two optimizers.

Two guarded Adam chains over the same parameters step in one jitted
function, with and without ``sync_loss_scales`` at its end, timed side by
side in interleaved rounds (``_common.interleaved``). Prints the median
ratio of the per-round times and its range (benchmarks/README.md).

  python benchmarks/sync_cost.py [--rounds 40] [--leaves 50] [--size 20000]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common  # noqa: E402  (puts the checkout on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import fp16_scaling as fs  # noqa: E402


def make_step(txs, sync):
  """One jitted step of both chains; ``sync``: end with the one scale."""

  @jax.jit
  def step(params, states, grads):
    out = [tx.update(grads, s, p) for tx, s, p in zip(txs, states, params)]
    states = tuple(s for _, s in out)
    if sync:
      states = fs.sync_loss_scales(*states)
    params = tuple(optax.apply_updates(p, u) for p, (u, _) in zip(params, out))
    return params, states

  return step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--leaves", type=int, default=50)
  parser.add_argument("--size", type=int, default=20_000)
  args = parser.parse_args(argv)
  params = {f"l{i}": jnp.ones(args.size) for i in range(args.leaves)}
  grads = jax.tree.map(lambda p: p * 0.01, params)
  txs = [
    fs.chain(fs.fp16_loss_scale(fs.torch_scaler()), optax.adam(1e-3))
    for _ in range(2)
  ]
  states = tuple(tx.init(params) for tx in txs)
  unit = [
    (
      sync,
      common.stepper(make_step(txs, sync), [(params,) * 2, states], grads, 20),
    )
    for sync in (False, True)
  ]
  wall, _ = common.split(common.interleaved([unit], args.rounds, warmup=2))
  plain, synced = wall[False], wall[True]
  ratios = sorted(common.paired(synced, plain))
  print(
    f"two Adam chains, {args.leaves} leaves x {args.size}: "
    f"{statistics.median(plain) * 1e3:.3f} ms without sync, "
    f"{statistics.median(synced) * 1e3:.3f} ms with; ratio "
    f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f} to "
    f"{ratios[-1]:.3f}, {len(ratios)} rounds)"
  )


if __name__ == "__main__":
  main()
