"""The README holds what a newcomer relies on: at most 8 KB; right after the
opening paragraphs the two commands (train the example, run the tests), the
second of them the one CI runs, then the fast loop without PyTorch and the
page of each framework's step; links and repository paths in the README and
docs/ that resolve; a preset table whose arguments are the presets' own; the
metric names scale_metrics returns; policy strings that give a float32 loss;
and a quickstart that runs as pasted and trains."""

import ast
import contextlib
import importlib.util
import inspect
import io
import pathlib
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp16_scaling as fs

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TEST_COMMAND = (
  "bash .ci/setup && .venv/bin/python -m pytest -q -n auto --dist loadfile"
)
FAST_LOOP = (
  'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && '
  '.venv/bin/python -m pytest -q -n auto --dist loadfile -m "not peers"'
)


def _section(title):
  text = README.read_text()
  start = text.index(f"\n## {title}\n")
  end = text.find("\n## ", start + 1)
  return text[start : end if end >= 0 else None]


def test_readme_is_at_most_8_kb():
  assert len(README.read_bytes()) <= 8192


def _opening():
  """The README's first screen: the text before its first section."""
  text = README.read_text()
  return text[: text.index("\n## ")]


def test_the_two_commands_come_right_after_the_opening_paragraphs():
  opening = _opening()
  # The README's first code block, before any section: two commands, with
  # only paragraphs of text before it.
  block, *_ = re.findall(r"```bash\n(.*?)```", opening, re.S)
  assert opening.index("```bash") > opening.index("\n\n")  # after the text
  assert "```" not in opening[: opening.index("```bash")]
  train, test = block.strip().splitlines()
  assert train == (
    'python3 -m venv .venv && .venv/bin/pip install -q -e ".[examples]" && '
    ".venv/bin/python examples/train_mlp.py"
  )
  assert (ROOT / "examples" / "train_mlp.py").is_file()
  assert test == TEST_COMMAND


def test_the_fast_loop_comes_next_and_leaves_pytorch_out():
  opening = _opening()
  blocks = re.findall(r"```bash\n(.*?)```", opening, re.S)
  assert len(blocks) == 2 and blocks[1].strip() == FAST_LOOP
  # The paragraph before it says what it costs (measured: 6 min 47 s on 2
  # cores for 1,154 tests).
  before = opening[: opening.index(FAST_LOOP)].rsplit("\n\n", 2)[-2]
  assert re.search(r"without PyTorch \(about \d+ minutes on \d+ cores", before)
  # The test extra has what the loop runs on, and no PyTorch.
  tomllib = pytest.importorskip("tomllib")  # Python 3.11+
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  extra = pyproject["project"]["optional-dependencies"]["test"]
  names = {re.split(r"[<>=!~ ]", req)[0] for req in extra}
  assert {"pytest", "flax", "equinox", "dm-haiku", "keras"} <= names
  assert not names & {"torch", "deepspeed", "megatron-core"}
  # With -m "not peers", tests/conftest.py leaves tests/peers/ (PyTorch,
  # DeepSpeed) unimported; with other marker expressions it collects it.
  spec = importlib.util.spec_from_file_location(
    "_readme_conftest", ROOT / "tests" / "conftest.py"
  )
  conftest = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(conftest)
  peers = ROOT / "tests" / "peers"
  for expr, ignored in [("not peers", True), ("peers", None), ("", None)]:
    config = types.SimpleNamespace(option=types.SimpleNamespace(markexpr=expr))
    assert conftest.pytest_ignore_collect(peers, config) is ignored, expr


def test_the_first_screen_links_each_frameworks_step():
  opening = _opening()
  assert "](docs/frameworks.md)" in opening
  # The NNX step, by its anchor: docs/frameworks.md's "## Flax NNX".
  assert "[Flax NNX](docs/frameworks.md#flax-nnx)" in opening
  headings = (ROOT / "docs" / "frameworks.md").read_text().splitlines()
  assert "## Flax NNX" in headings
  for name in ["Flax Linen", "Equinox", "Haiku", "Keras 3", "plain JAX"]:
    assert name in opening, name
  assert "](docs/porting.md)" in opening


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


def _quickstart():
  """The first Python block after "## Quickstart": what CI runs from the
  installed wheel, outside the checkout."""
  return re.findall(r"```python\n(.*?)```", _section("Quickstart"), re.S)[0]


def test_quickstart_needs_only_jax_optax_and_fp16_scaling():
  imported = set()
  for node in ast.walk(ast.parse(_quickstart())):
    if isinstance(node, ast.Import):
      imported |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add(node.module.split(".")[0])
  assert imported == {"jax", "optax", "fp16_scaling"}


def test_quickstart_runs_as_pasted_trains_and_skips_its_overflow():
  code = _quickstart()
  assert "fs.value_and_grad(loss_fn, opt_state)(params, batch)" in code
  # The hand-written form is named beside it.
  assert "loss * fs.current_scale(opt_state)" in _section("Quickstart")

  env, out = {"__name__": "__main__"}, io.StringIO()
  with contextlib.redirect_stdout(out), warnings.catch_warnings():
    warnings.simplefilter("error")  # no float16-loss or other warning
    exec(compile(code, "README.md quickstart", "exec"), env)

  metrics = jax.device_get(fs.scale_metrics(env["opt_state"]))
  # Only the batch with 1e5 (beyond float16's 65504) overflowed; its loss
  # is inf, a forward overflow; torch_scaler halved 2**16 once.
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == 2.0**15
  assert not bool(metrics["overflow"])
  report = out.getvalue()
  assert "Skipped steps so far: 1;" in report, report
  assert "loss scale 2^15" in report, report
  # It trains: the weights reach w_true, from zeros, within what float16
  # compute leaves (2^-11 relative per product, far below 1e-3 here).
  w, w_true = np.asarray(env["params"]["w"]), np.asarray(env["w_true"])
  np.testing.assert_allclose(w, w_true, atol=1e-3)
  loss_fn, batches = env["loss_fn"], env["batches"]
  zeros = {"w": jnp.zeros(4)}
  assert float(loss_fn(env["params"], batches[0])) < (
    float(loss_fn(zeros, batches[0])) / 100
  )


def _policy_case():
  """A torch_scaler state (2**16) and a loss that computes in float16 under
  a policy and returns float32, as the README's loss_fn does."""
  params, x = {"w": jnp.ones(3)}, jnp.full((2, 3), 0.25)
  state = fs.chain(fs.fp16_loss_scale(fs.torch_scaler())).init(params)
  loss = lambda p, x: jnp.mean((x @ p["w"]).astype(jnp.float32))
  return state, loss, params, x


def test_every_policy_string_in_the_readme_gives_a_float32_loss():
  policies = re.findall(r'policy="([^"]+)"', README.read_text())
  assert policies  # "What runs in float16"
  state, loss, params, x = _policy_case()
  for policy in policies:
    assert fs.get_policy(policy).output_dtype == jnp.float32, policy
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      value, grads = fs.value_and_grad(
        loss, state, policy=policy, cast_args=(1,)
      )(params, x)
    assert value.dtype == grads["w"].dtype == jnp.float32
    # The loss's cotangent is S = 2**16 in float32, each row's S / 2 in
    # float16: the gradients are finite, mean(x @ w)'s exact gradient 0.25
    # times S (powers of two: no rounding).
    np.testing.assert_array_equal(grads["w"], np.full(3, 2.0**14))


def test_the_float16_loss_warning_names_the_policy_and_the_fix():
  state, loss, params, x = _policy_case()
  # "c=f16": the output follows compute, so the policy casts the float32
  # loss to float16, and its cotangent, 2**16, is inf in float16.
  half = fs.value_and_grad(loss, state, policy="c=f16", cast_args=(1,))
  with pytest.warns(UserWarning, match="float16 loss") as got:
    value, grads = half(params, x)
  (message,) = [str(w.message) for w in got]
  assert "policy=p=full,c=f16,o=f16 casts fun's loss" in message, message
  assert "o=f32" in message and "p=f32,c=f16,o=f32" in message
  assert value.dtype == jnp.float16
  assert not np.isfinite(np.asarray(grads["w"])).any()  # why it warns
  # A float16 loss of the function's own, without a policy: the warning
  # names the reduction, not a policy.
  own = lambda p, x: jnp.mean(x.astype(jnp.float16) @ p["w"].astype("f2"))
  with pytest.warns(UserWarning, match="float16 loss") as got:
    fs.value_and_grad(own, state)(params, x)
  (message,) = [str(w.message) for w in got]
  assert "policy=" not in message and "Reduce the loss in float32" in message


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
