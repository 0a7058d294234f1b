"""Runs examples/train_policy.py (short) and checks what it claims: float16
compute from float32 parameters with float32 gradients, through a policy
string, and that it learns."""

import runpy

from helpers import ROOT
import jax.numpy as jnp
import pytest

pytest.importorskip("sklearn")

EXAMPLE = ROOT / "examples" / "train_policy.py"


@pytest.fixture(scope="module")
def main():
  return runpy.run_path(str(EXAMPLE))["main"]  # not run as __main__


def test_float16_compute_float32_gradients_and_it_learns(main):
  result = main(["--steps", "150"])
  assert result["policy"] == "p=full,c=f16,o=full"
  assert result["compute_dtype"] == jnp.float16
  assert result["grad_dtypes"] == {jnp.dtype(jnp.float32)}
  assert result["param_dtypes"] == {jnp.dtype(jnp.float32)}
  assert result["loss_dtype"] == jnp.float32  # fs.float32 on the loss
  losses = result["losses"]
  assert losses[-10:].mean() < losses[:10].mean() / 4
  assert result["accuracy"] > 0.85  # chance is 0.1


def test_any_jmp_spec_selects_the_policy(main):
  result = main(["--steps", "20", "--policy", "full"])
  assert result["compute_dtype"] == jnp.float32
  assert result["grad_dtypes"] == {jnp.dtype(jnp.float32)}
  with pytest.raises(ValueError, match="unknown dtype 'f8' for key 'c'"):
    main(["--steps", "1", "--policy", "c=f8"])
