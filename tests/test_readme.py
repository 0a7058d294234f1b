"""The README holds what a newcomer relies on: at most 8 KB; right after the
opening paragraphs the two commands (train the example, run the tests), the
second of them the one CI runs; links and repository paths in the README and
docs/ that resolve; a preset table whose arguments are the presets' own; the
metric names scale_metrics returns; and a quickstart that trains."""

import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

import fp16_scaling as fs

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TEST_COMMAND = (
  "bash .ci/setup && .venv/bin/python -m pytest -q -n auto --dist loadfile"
)


def _section(title):
  text = README.read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start : end if end >= 0 else None]


def test_readme_is_at_most_8_kb():
  assert len(README.read_bytes()) <= 8192


def test_the_two_commands_come_right_after_the_opening_paragraphs():
  text = README.read_text()
  opening = text[: text.index("\n## ")]
  # The README's first code block, before any section: two commands.
  (block,) = re.findall(r"```bash\n(.*?)```", opening, re.S)
  assert opening.index("```bash") > opening.index("\n\n")  # after the text
  assert opening.rstrip().endswith("```")  # and nothing after them
  train, test = block.strip().splitlines()
  assert train == (
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[examples]" && '
    ".venv/bin/python examples/train_mlp.py"
  )
  assert (ROOT / "examples" / "train_mlp.py").is_file()
  assert test == TEST_COMMAND


def test_readme_test_command_is_what_ci_runs():
  # .ci/run's first command is the README's, exactly: a line of its own, not
  # a comment, with nothing added to it.
  lines = [
    line.strip()
    for line in (ROOT / ".ci" / "run").read_text().splitlines()
    if line.strip() and not line.lstrip().startswith("#")
  ]
  commands = [line for line in lines if "pytest" in line]
  assert commands[0] == TEST_COMMAND, commands
  assert (ROOT / ".ci" / "setup").is_file()


def test_readme_says_what_the_test_command_costs():
  # The paragraph right before the command: the time and the download size.
  text = README.read_text()
  before = text[: text.index(TEST_COMMAND)].rsplit("\n\n", 2)[-2]
  assert re.search(r"about \d+ minutes on\s+\d+ cores", before), before
  assert re.search(r"~\d+ GB\s+of downloads", before), before


def test_relative_links_resolve():
  # Markdown links and images, relative to their page; anchors dropped.
  checked = 0
  for page in PAGES:
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      if re.match(r"[a-z]+:", link) or link.startswith("#"):
        continue
      assert (page.parent / link.split("#")[0]).exists(), (page.name, link)
      checked += 1
  assert checked >= 15, checked


def test_repository_paths_named_in_the_text_exist():
  # "benchmarks/train_step_cost.py", "tests/peers/...": what a reader would
  # open next, relative to the repository root.
  checked = 0
  for page in PAGES:
    named = re.findall(
      r"(?<![\w/.])((?:tests|examples|benchmarks|docs|fp16_scaling|\.ci)"
      r"/[\w./-]*\w)",
      page.read_text(),
    )
    for path in named:
      assert (ROOT / path).exists(), (page.name, path)
      checked += 1
  assert checked >= 50, checked


def test_the_preset_table_uses_the_presets_own_arguments():
  rows = re.findall(
    r"^\| .* \| `(\w+)\((.*?)\)`", _section("Which preset"), re.M
  )
  named = [name for name, _ in rows]
  assert named == [
    "torch_scaler",
    "deepspeed_scaler",
    "from_deepspeed_config",
    "megatron_scaler",
    "flax_scaler",
    "jmp_scaler",
    "keras_scaler",
    "static_scaler",
    "headroom_scaler",
    "no_scaler",
  ]
  for name, args in rows:
    params = inspect.signature(getattr(fs, name)).parameters
    for arg in re.findall(r"(\w+)=", args):
      assert arg in params, (name, arg)
      assert params[arg].kind is inspect.Parameter.KEYWORD_ONLY, (name, arg)
  # "torch_scaler() starts at 2**16, halves on an overflow and doubles
  # after 2,000 clean steps."
  torch = fs.torch_scaler()
  assert (torch.init_scale, torch.backoff_factor) == (2.0**16, 0.5)
  assert (torch.growth_factor, torch.growth_interval) == (2.0, 2000)


def test_the_metrics_named_are_the_metrics_returned():
  text = _section("Metrics")
  named = {m for m in re.findall(r"`(\w+)`", text) if not m.startswith("fs")}
  tx = fs.chain(
    fs.fp16_loss_scale(fs.torch_scaler(), grad_range=True),
    fs.clip_by_unscaled_norm(1.0, expert_mask={"w": True, "b": False}),
  )
  state = tx.init({"w": jnp.ones(2), "b": jnp.ones(1)})
  assert named == set(fs.scale_metrics(state))
  # The accumulation section names the keys accumulate_gradients adds.
  acc = fs.accumulate_gradients(tx, 2).init(
    {"w": jnp.ones(2), "b": jnp.ones(1)}
  )
  added = set(fs.scale_metrics(acc)) - set(fs.scale_metrics(state))
  said = set(re.findall(r"`(\w+)`", _section("Gradient accumulation")))
  assert added and added <= said, (added, said)


def test_quickstart_trains_and_skips_an_overflow():
  (code,) = re.findall(r"```python\n(.*?)```", _section("Quickstart"), re.S)
  assert "fs.value_and_grad(loss_fn, opt_state)(params, batch)" in code
  # The hand-written form is named beside it.
  assert "loss * fs.current_scale(opt_state)" in _section("Quickstart")

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
