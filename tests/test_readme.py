"""The README holds what it promises: at most 8 KB, the CI command, links
that resolve, and a quickstart that trains."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEST_COMMAND = "bash .ci/setup && .venv/bin/python -m pytest -q"


def _section(title):
  text = README.read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start : end if end >= 0 else None]


def test_readme_is_at_most_8_kb():
  assert len(README.read_bytes()) <= 8192


def test_readme_test_command_is_what_ci_runs():
  assert TEST_COMMAND in README.read_text()
  assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_readme_says_what_the_test_command_costs():
  # The paragraph right before the command: the time and the download size.
  text = README.read_text()
  before = text[: text.index(TEST_COMMAND)].rsplit("\n\n", 2)[-2]
  assert re.search(r"about \d+ minutes on\s+\d+ cores", before), before
  assert re.search(r"~\d+ GB\s+of downloads", before), before


def test_readme_links_resolve():
  links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
  assert links
  for link in links:
    assert (ROOT / link).exists(), link


def test_quickstart_trains_and_skips_an_overflow():
  (code,) = re.findall(r"```python\n(.*?)```", _section("Quickstart"), re.S)
  assert "loss * fs.current_scale(opt_state)" in code

  rng = np.random.default_rng(0)
  # Small weights: adamw(1e-3) moves each by about 1e-3 a step.
  w_true = 0.05 * rng.standard_normal(4).astype(np.float32)
  batches = []
  for i in range(150):
    x = rng.standard_normal((16, 4)).astype(np.float32)
    if i == 100:
      x[0, 0] = 1e5  # beyond float16's range: this step must be skipped
    batches.append((jnp.asarray(x), jnp.asarray(x @ w_true)))

  def loss_fn(params, batch):
    x, y = batch
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

  params = {"w": jnp.zeros(4, jnp.float32)}
  first = float(loss_fn(params, batches[0]))
  env = dict(params=params, loss_fn=loss_fn, batches=batches)
  exec(code, env)

  metrics = jax.device_get(env["metrics"])
  # Only the injected step overflowed; torch_scaler halved 2**16 once.
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 2.0**15
  assert not bool(metrics["overflow"])
  assert np.isfinite(np.asarray(env["params"]["w"])).all()
  assert float(loss_fn(env["params"], batches[0])) < first / 10


def test_nothing_points_outside_the_project():
  # The team's working notes live outside the repository; the project states
  # what it relies on in docs/ instead. (Spelled in two parts so that this
  # file does not match itself.)
  outside = "shared" + "/"
  files = [README, ROOT / "pyproject.toml", *(ROOT / ".ci").iterdir()]
  for folder in ("fp16_scaling", "tests", "docs", "examples", "benchmarks"):
    files += [
      p
      for p in (ROOT / folder).rglob("*")
      if p.suffix in (".py", ".md", ".toml", ".txt") and p.is_file()
    ]
  assert len(files) > 20
  for path in files:
    assert outside not in path.read_text(errors="replace"), path
