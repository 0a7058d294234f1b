"""``compute_dtypes``: which dtype each matmul, convolution, sum, exp, log
and rsqrt of a step runs in, read from the lowered program (StableHLO text,
what XLA is given), with the matmul and convolution FLOPs per dtype.
"""

import math
import re
from typing import Any, Callable, Dict, NamedTuple, Optional

import jax

# The kinds counted, by StableHLO op; a reduce counts when it adds (a sum).
KINDS = {
  "dot_general": "matmul",
  "convolution": "convolution",
  "reduce": "sum",
  "exponential": "exp",
  "exponential_minus_one": "exp",
  "log": "log",
  "log_plus_one": "log",
  "rsqrt": "rsqrt",
}
_PRODUCTS = ("matmul", "convolution")  # the kinds whose FLOPs are counted
# The rows of the table: the kinds, a sum in the backward pass apart.
_ROWS = (
  "matmul",
  "convolution",
  "sum",
  "backward sum",
  "exp",
  "log",
  "rsqrt",
)
_DTYPES = {
  "f16": "float16",
  "bf16": "bfloat16",
  "f32": "float32",
  "f64": "float64",
}
_HALF = ("float16", "bfloat16")
_FRAMES = 4  # the source lines first_float32 names, innermost first
_NAME = r'@("[^"]+"|[\w.$-]+)'  # a function's, quoted if need be
_FUNC = re.compile(r"^\s*func\.func \w+ " + _NAME)
# A call, or a composite op (lax.composite), whose decomposition XLA
# inlines unless the backend implements the composite itself.
_CALL = re.compile(r"(?:= (?:func\.)?call |decomposition = )" + _NAME)
_OP = re.compile(r"= stablehlo\.(\w+)[ (]")
_SIGNATURE = re.compile(r" : \(?tensor<")
# A tensor type's shape and element type (``complex<f32>``'s: "complex").
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(\w+)")
_CONV_KERNEL = re.compile(r"x\[([^\]]*)\]->")  # a convolution's rhs layout
_CONTRACTING = re.compile(r"contracting_dims = \[([\d, ]*)\]")
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.M)
_LOC_NAME = re.compile(r'"([^"]*)"\(')  # an op's name stack
_FILE_LINE = re.compile(r'"([^"]*)":(\d+):\d+.*')


class _Op(NamedTuple):
  """A counted op of the lowered program."""

  kind: str
  dtype: str
  flops: int
  loc: Optional[str]  # its location's reference, "#loc12"
  text: str  # its name and operand types


class _Call(NamedTuple):
  """A call of a function of the lowered program."""

  function: str
  loc: Optional[str]


class ComputeDtypes(NamedTuple):
  """What a lowered step computes in; see :func:`compute_dtypes`.

  Attributes:
    counts: op kind -> dtype name -> how many ops of that kind the program
      runs in that dtype (floating ones only; an op's dtype is its first
      operand's). The kinds: ``matmul`` (``dot_general``), ``convolution``,
      ``sum`` (a reduce that adds, in the forward pass: statistics, a
      softmax's denominator, a loss's mean, an optimizer's norms),
      ``backward sum`` (one in the backward pass, which JAX names
      ``transpose``: a bias's gradient, summed in its layer's dtype),
      ``exp`` (``exp``, ``expm1``), ``log`` (``log``, ``log1p``) and
      ``rsqrt`` (a norm's scale). Every kind is a key, an empty dict if none
      ran.
    flops: dtype name -> the FLOPs of the matmuls and convolutions in that
      dtype (2 per multiply-add, as the op's shapes give them).
    first_float32: the first matmul or convolution in program order (the
      forward pass first) that runs in neither float16 nor bfloat16, with
      its operand types and, where the lowered program records them, the
      source lines that made it, innermost first; None if there is none.
  """

  counts: Dict[str, Dict[str, int]]
  flops: Dict[str, int]
  first_float32: Optional[str] = None

  def share(self, dtype: str = "float16") -> float:
    """The share of the matmul and convolution FLOPs in ``dtype`` (a
    name such as ``"float16"``), from 0 to 1; 0.0 with no such op."""
    total = sum(self.flops.values())
    return self.flops.get(dtype, 0) / total if total else 0.0

  def __str__(self) -> str:
    """The FLOPs' shares, a table of the counts (a row a kind, a column a
    dtype) and the first float32 product, if any."""
    dtypes = [*_HALF, "float32"]
    dtypes += [d for d in self.flops if d not in dtypes]
    shares = ", ".join(f"{self.share(d):.1%} {d}" for d in dtypes)
    lines = [
      f"Matmul and convolution FLOPs ({sum(self.flops.values()):.3g}): "
      f"{shares}",
      f"{'op':<12}" + "".join(f"{d:>10}" for d in dtypes),
    ]
    for kind, by_dtype in self.counts.items():
      row = "".join(f"{by_dtype.get(d, 0):>10}" for d in dtypes)
      lines.append(f"{kind:<12}{row}")
    lines.append(
      f"First matmul/convolution in float32: {self.first_float32}"
      if self.first_float32
      else "No matmul or convolution runs in float32."
    )
    return "\n".join(lines)


def _flops(op: str, line: str, shapes: list) -> int:
  """The FLOPs of a matmul or convolution ``line``, from its operand and
  result ``shapes``: 2 per multiply-add."""
  lhs, rhs, out = shapes[:3]
  if op == "convolution":
    # Each output sums over the whole kernel but its output features.
    layout = _CONV_KERNEL.search(line)[1].replace(" ", "").split(",")
    terms = math.prod(rhs) // rhs[layout.index("o")]
  else:
    dims = _CONTRACTING.search(line)[1]  # "" when none: an outer product
    axes = [int(a) for a in dims.split(",") if a.strip()]
    terms = math.prod(lhs[a] for a in axes)
  return 2 * math.prod(out) * terms


def _op(line: str) -> Optional[_Op]:
  """The :class:`_Op` of ``line``, or None: another op, a reduce that does
  not add, a non-floating one."""
  op = _OP.search(line)
  signature = _SIGNATURE.search(line)
  if op is None or op[1] not in KINDS or signature is None:
    return None
  if op[1] == "reduce" and "applies stablehlo.add " not in line:
    return None
  types = _TENSOR.findall(line[signature.start() :])
  dtype = _DTYPES.get(types[0][1])
  if dtype is None:
    return None
  kind, flops = KINDS[op[1]], 0
  if kind in _PRODUCTS:
    shapes = [[int(d) for d in dims.split("x") if d] for dims, _ in types]
    flops = _flops(op[1], line, shapes)
  loc = _LOC_REF.search(line)
  end = loc.start() if loc else None
  text = line[signature.start() + 3 : end].strip()
  return _Op(
    kind=kind,
    dtype=dtype,
    flops=flops,
    loc=loc and loc[1],
    text=f"{op[1]} {text}",
  )


def _functions(text: str) -> dict:
  """``{function name: [its _Op and _Call entries, in order]}``."""
  functions, body = {}, []
  for line in text.splitlines():
    func, call, op = _FUNC.match(line), _CALL.search(line), _op(line)
    loc = _LOC_REF.search(line)
    if func:
      body = functions.setdefault(func[1], [])
    elif call:
      body.append(_Call(call[1], loc and loc[1]))
    elif op:
      body.append(op)
  return functions


def _ops(functions: dict, locs: dict, name: str, backward: bool = False):
  """The :class:`_Op`s of function ``name`` in program order, each called
  function's at its call (a function called twice, twice); a sum in the
  backward pass (JAX names it ``transpose(...)``) as ``backward sum``."""
  for entry in functions.get(name, ()):
    named = _LOC_NAME.match(locs.get(entry.loc, ""))
    back = backward or bool(named and "transpose(" in named[1])
    if isinstance(entry, _Call):
      yield from _ops(functions, locs, entry.function, back)
    elif back and entry.kind == "sum":
      yield entry._replace(kind="backward sum")
    else:
      yield entry


def _frames(locs: dict, ref: str) -> list:
  """The source lines of location ``ref``, innermost first, as
  ``file:line (function)``."""
  body = locs.get(ref, "")
  site = re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", body)
  if site:
    return _frames(locs, site[1]) + _frames(locs, site[2])
  named = re.fullmatch(r'"([^"]*)"\((#loc\d*)\)', body)
  if named:  # a function's name on its line, or an op's name on the stack
    where = _FILE_LINE.fullmatch(locs.get(named[2], ""))
    if where is None:
      return _frames(locs, named[2])
    return [f"{where[1]}:{where[2]} ({named[1]})"]
  where = _FILE_LINE.fullmatch(body)
  return [f"{where[1]}:{where[2]}"] if where else []


def _lowered_text(fun: Callable[..., Any], args, kwargs) -> str:
  """The StableHLO text of ``fun`` lowered for ``args``, with locations."""
  if not callable(fun):
    raise TypeError(
      f"fs.compute_dtypes: fun must be a function, got a {type(fun).__name__}"
    )
  lower = getattr(fun, "lower", None) or jax.jit(fun).lower
  lowered = lower(*args, **kwargs)
  lowered = getattr(lowered, "lowered", lowered)  # eqx.filter_jit's wrapper
  return lowered.as_text(debug_info=True)


def compute_dtypes(fun: Callable[..., Any], *args, **kwargs) -> ComputeDtypes:
  """Which dtype each matmul, convolution, sum, exp, log and rsqrt of
  ``fun`` runs in, read from its lowered program.

  ``fun`` is lowered for ``args`` (``fun.lower(*args, **kwargs)`` when it
  has one: a ``jax.jit``, ``nnx.jit`` or ``eqx.filter_jit`` function, whose
  arguments may be modules; else ``jax.jit(fun)``'s), nothing is compiled
  or run, and the StableHLO text is read: the program JAX hands XLA, the
  backward pass included. A function called twice counts twice; an op
  inside a loop body (``lax.scan``) counts once, and so does each branch
  of a ``lax.cond``; a ``lax.composite`` counts its decomposition. A
  custom call is opaque, its products not counted: a Pallas kernel, or
  cuDNN's attention, which ``jax.nn.dot_product_attention`` may pick on
  a GPU for float16 inputs. XLA may fuse or reorder below this, but not
  change what a matmul multiplies in.

  Args:
    fun: the step or the loss, as it is called.
    *args: its arguments: arrays, or ``jax.ShapeDtypeStruct`` shapes.
    **kwargs: its keyword arguments.

  Returns:
    A :class:`ComputeDtypes`; ``print`` it for the table.

  Raises:
    TypeError: ``fun`` is not callable; or what lowering raises, e.g. for
      a module passed to a plain function (pass ``eqx.filter_jit(fun)``
      or ``nnx.jit(fun)``).

  Examples:
    >>> import jax.numpy as jnp, fp16_scaling as fs
    >>> def f(w, x):
    ...   return jnp.sum(x.astype(jnp.float16) @ w.astype(jnp.float16))
    >>> report = fs.compute_dtypes(f, jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> report.counts["matmul"], report.share("float16")
    ({'float16': 1}, 1.0)
  """
  text = _lowered_text(fun, args, kwargs)
  locs = dict(_LOC_DEF.findall(text))
  counts = {kind: {} for kind in _ROWS}
  flops, first = {}, None
  for op in _ops(_functions(text), locs, "main"):
    counts[op.kind][op.dtype] = counts[op.kind].get(op.dtype, 0) + 1
    if op.kind not in _PRODUCTS:
      continue
    flops[op.dtype] = flops.get(op.dtype, 0) + op.flops
    if first is None and op.dtype not in _HALF:
      frames = _frames(locs, op.loc)[:_FRAMES]
      first = op.text + "".join(f"\n  at {f}" for f in frames)
  return ComputeDtypes(counts, flops, first)
