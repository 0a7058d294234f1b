"""Runs examples/train_multihost.py as two processes on loopback, with the
launch line its docstring gives (fewer steps)."""

import os
import re
import sys

import helpers

EXAMPLE = str(helpers.ROOT / "examples" / "train_multihost.py")


def test_two_processes_train_and_agree():
  port = helpers.free_port()
  cmd = [sys.executable, EXAMPLE, "--cpu-devices", "2", "--steps", "12"]
  cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
  cmds = [cmd + ["--process-id", str(i)] for i in range(2)]
  finals = []
  for code, log in helpers.launch(cmds, os.environ):
    assert code == 0, log[-4000:]
    finals.append(re.search(r"process (\d)/2: (final .*)", log).groups())
  assert [f[0] for f in finals] == ["0", "1"]
  assert finals[0][1] == finals[1][1]  # the same loss, scale and weights
  # 2**20 overflows float16 for the first steps: they were skipped.
  skipped = int(re.search(r"skipped (\d+)", finals[0][1]).group(1))
  assert skipped >= 3
