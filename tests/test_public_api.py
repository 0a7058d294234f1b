"""What the package exports is reachable under its public name."""

import pickle

import fp16_scaling as fs


def test_every_exported_name_resolves():
  assert sorted(fs.__all__) == sorted(set(fs.__all__))
  for name in fs.__all__:
    assert getattr(fs, name) is not None, name


def test_exceptions_carry_their_public_path():
  # A traceback, a log line or a pickled exception names fp16_scaling's
  # public path, not the private module that defines it.
  err = fs.MinLossScaleError("at the floor")
  assert issubclass(fs.MinLossScaleError, RuntimeError)
  assert type(err).__module__ == "fp16_scaling"
  assert f"{type(err).__module__}.{type(err).__qualname__}" == (
    "fp16_scaling.MinLossScaleError"
  )
  back = pickle.loads(pickle.dumps(err))
  assert type(back) is fs.MinLossScaleError and back.args == err.args


def test_the_interop_names_are_the_packages_own():
  # fp16_scaling.interop re-exports its modules' public names; the top level
  # exports the very same objects, so users see no change from the move.
  import fp16_scaling.interop as interop

  assert set(interop.__all__) <= set(fs.__all__)
  for name in interop.__all__:
    assert getattr(fs, name) is getattr(interop, name), name
