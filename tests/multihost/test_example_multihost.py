"""Runs examples/train_multihost.py as two processes on loopback, with the
launch line its docstring gives (fewer steps)."""

import os
import re
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLE = os.path.join(ROOT, "examples", "train_multihost.py")


def test_two_processes_train_and_agree():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  )
  cmd = [sys.executable, EXAMPLE, "--cpu-devices", "2", "--steps", "12"]
  cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
  procs = [
    subprocess.Popen(
      cmd + ["--process-id", str(i)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    logs = [p.communicate(timeout=110)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  finals = []
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
    finals.append(re.search(r"process (\d)/2: (final .*)", log).groups())
  assert [f[0] for f in finals] == ["0", "1"]
  assert finals[0][1] == finals[1][1]  # the same loss, scale and weights
  # 2**20 overflows float16 for the first steps: they were skipped.
  skipped = int(re.search(r"skipped (\d+)", finals[0][1]).group(1))
  assert skipped >= 3
