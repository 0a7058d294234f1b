"""What the package exports is reachable under its public name."""

import os
import pathlib
import pickle
import re
import subprocess
import sys

import helpers
import pytest

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


def test_the_version_lives_in_one_place():
  # pyproject.toml states no version of its own: setuptools reads
  # fp16_scaling.__version__ (what .ci/wheel checks the built wheel has).
  tomllib = pytest.importorskip("tomllib")  # Python 3.11+
  root = pathlib.Path(__file__).resolve().parents[1]
  config = tomllib.loads((root / "pyproject.toml").read_text())
  assert "version" not in config["project"]
  assert config["project"]["dynamic"] == ["version"]
  attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  assert attr == "fp16_scaling.__version__"
  assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", fs.__version__)
  # The license the metadata names is the file it ships.
  assert config["project"]["license"] == "Apache-2.0"
  assert config["project"]["license-files"] == ["LICENSE"]
  head = (root / "LICENSE").read_text().split("\n", 4)[:4]
  assert [line.strip() for line in head] == [
    "",
    "Apache License",
    "Version 2.0, January 2004",
    "http://www.apache.org/licenses/",
  ]


def test_fs_keras_is_imported_on_first_use():
  # import fp16_scaling imports no Keras; fs.keras does, on Keras's JAX
  # backend when KERAS_BACKEND is unset, and exports its three names. A
  # fresh process: Keras reads its backend once.
  pytest.importorskip("keras")
  script = (
    "import sys\n"
    "import fp16_scaling as fs\n"
    "assert 'keras' not in sys.modules\n"
    "names = fs.keras.__all__\n"
    "import keras\n"
    "print(keras.backend.backend(), sorted(names))\n"
    "print([getattr(fs.keras, n).__module__ for n in names])\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
  out = subprocess.run(
    [sys.executable, "-c", script],
    env=env,
    cwd=helpers.ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.splitlines()
  assert out == [
    "jax ['KeepStateOnSkip', 'Optimizer', 'keep_state_on_skip']",
    str(["fp16_scaling.keras"] * 3),
  ]
  assert "keras" not in fs.__all__  # no star import pulls Keras in
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    _ = fs.not_a_name
