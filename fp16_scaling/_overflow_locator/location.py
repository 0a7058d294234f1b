"""``OverflowLocation``: what :func:`locate_overflow` found, and what to do
about it; and how one op of its run is described (its module, source
line, name scope, float32 magnitude), from the public attributes of the
equations ``jax.make_jaxpr`` returns."""

import dataclasses
import math
import os
import re
import sysconfig
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from fp16_scaling._diagnostics import fmt_scale
from fp16_scaling._scaler import F16_MAX
from fp16_scaling._validate import library_roots

_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def floating(x) -> bool:
  """Whether ``x`` is a floating (or complex) array or scalar."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def finite(x) -> bool:
  """Whether ``x`` holds no inf or NaN (True for a non-floating ``x``)."""
  return not floating(x) or bool(np.all(np.isfinite(x)))


def bind(eqn, values, params=None) -> list:
  """``eqn``'s primitive applied to ``values`` (with ``params``, else the
  equation's), as a list of outputs."""
  params = dict(eqn.primitive.get_bind_params(params or eqn.params))
  subfuns = params.pop("subfuns", ())  # a call primitive's, as it binds
  out = eqn.primitive.bind(*subfuns, *values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def module_of(floats):
  """``(module, fed, view)`` of an op with the floating inputs ``floats``
  (``_locator`` values): the module of the parameters among them, else
  the nearest of its forward inputs' (a cotangent comes from the modules
  after the op); whether parameters feed it; whether its output is a view
  of them (casts, reshapes and slices of parameters: constants aside)."""
  params = [i for i in floats if i.param]
  forward = [i for i in floats if i.module is not None and not i.back]
  paths = [i.module for i in params or forward]
  module = os.path.commonprefix(paths) if paths else None
  fed = bool(params)
  neutral = [i.param is not False for i in floats]
  return module, fed, fed and all(neutral)


@dataclasses.dataclass(frozen=True)
class OverflowLocation:
  """Where a step's first float16 inf or NaN came from; see
  :func:`locate_overflow`.

  Attributes:
    kind: "none" (nothing overflowed at ``scale``), "forward" (an op of the
      forward pass), "backward" (an op of the backward pass: its cotangent,
      at ``scale``) or "input" (an argument already held an inf or NaN).
    scale: the loss scale of the re-run.
    primitive: the op, a JAX primitive (``dot_general``, ``exp``, ...).
    shape: the shape of its output that is not finite (of an op of several
      outputs, such as a ``while`` loop, the first such).
    dtype: that output's dtype.
    max_input: the largest finite ``|x|`` among its floating inputs.
    float32_max: the largest ``|y|`` of its output computed in float32 from
      the same inputs (inf: float32 gives an inf or NaN too, as a log or a
      division of 0 does; nan: the op refused float32 inputs).
    constant: the inf was no op's result but a constant the op wrote (a
      mask filled with ``-inf``), and nothing else overflowed.
    filename: the file of the user's source line of the op: the innermost
      frame outside JAX, the frameworks and fp16_scaling (None if none).
    lineno: that line's number.
    function: the function that line is in.
    module: the path of the module whose parameters feed the op (as the
      state names its leaves, ``['params']['Dense_1']``, ``.layers[1]``),
      or, with ``direct`` False, that of the nearest module upstream in
      the forward pass; None in a plain function of its arguments.
    direct: whether ``module``'s parameters feed the op itself.
    scope: the op's name stack (Flax Linen, Haiku and Equinox name their
      modules there), without the transformations.
    layers: the iterations of the ``scan`` s around the op, outermost
      first: the layer index of a scanned stack.
    safe_scale: for a backward op, the largest power-of-two scale at which
      its output stays within float16's range.
    step_scale: for a backward overflow, the largest power-of-two scale at
      which the step's loss and gradients on this batch are all finite
      (the compiled gradient function, tried from ``safe_scale`` down);
      None if none is, down to 2^-24.
    input_path: for ``kind="input"``, the argument leaf (``args[1]['x']``).
  """

  kind: str
  scale: float
  primitive: Optional[str] = None
  shape: tuple = ()
  dtype: Optional[str] = None
  max_input: float = 0.0
  float32_max: float = 0.0
  constant: bool = False
  filename: Optional[str] = None
  lineno: Optional[int] = None
  function: Optional[str] = None
  module: Optional[str] = None
  direct: bool = False
  scope: str = ""
  layers: tuple = ()
  safe_scale: Optional[float] = None
  step_scale: Optional[float] = None
  input_path: Optional[str] = None

  def source(self) -> str:
    """``file:line`` of the op (the file relative to the working directory
    when it lies under it), or "" without a line of the user's."""
    if self.filename is None:
      return ""
    name = self.filename
    if name.startswith(os.getcwd() + os.sep):
      name = os.path.relpath(name)
    return f"{name}:{self.lineno}"

  def advice(self) -> str:
    """What to do about it."""
    at = f" at {self.source()}" if self.filename else ""
    if self.kind == "none":
      return (
        "If the step overflowed, it was on another batch: pass the one it "
        "overflowed on (or scale= to try another scale)."
      )
    if self.kind == "input":
      return (
        "No scale or float32 op fixes an inf or NaN in the input: a bad "
        "batch (filter it on the host), or a parameter that diverged."
      )
    if self.constant:
      return (
        f"The op{at} writes a constant inf (a -inf mask) that reaches the "
        "loss or the gradients: a row masked entirely? Mask with a large "
        "finite negative (jnp.finfo(dtype).min) instead."
      )
    if math.isinf(self.float32_max):
      return (
        "The op gives an inf or NaN in float32 too, from the same inputs, "
        "so computing it in float32 does not help. Either it is a log, a "
        "division or a square root of 0 or of a negative, such as an input "
        "that underflowed to 0 in float16 (a softmax's probability): "
        "compute that input in float32, or stay in the log domain "
        "(jax.nn.log_softmax); or its inputs are past any range (a "
        "diverged parameter or activation): check the batch and the "
        "learning rate."
      )
    if self.kind == "forward":
      return (
        "No loss scale changes the forward pass. Compute the op"
        f"{at} in float32: wrap the function that computes it in "
        "fs.float32 (docs/float32-ops.md), or keep its module in float32 "
        "with a policy."
      )
    if self.step_scale is None:
      return (
        "No loss scale down to 2^-24 makes the gradients finite on this "
        f"batch: compute the op{at} in float32 (fs.float32), and check "
        "the batch and the parameters."
      )
    return (
      f"At loss scale {fmt_scale(self.safe_scale)} this op's cotangent "
      f"fits float16, and at {fmt_scale(self.step_scale)} the whole "
      "step's. A dynamic scaler backs off there by itself: act only if it "
      f"keeps doing so. Start lower (init_scale={self.step_scale:g}), or "
      f"compute the op{at} in float32 (fs.float32)."
    )

  def __str__(self) -> str:
    scale = fmt_scale(self.scale)
    if self.kind == "none":
      lines = [f"Nothing overflows at loss scale {scale} on this batch."]
    elif self.kind == "input":
      lines = [
        f"At loss scale {scale}, an argument already holds an inf or NaN "
        f"before any op, at {self.input_path}."
      ]
    else:
      lines = self._op_lines(scale)
    if self.module is not None:
      how = "its parameters feed the op" if self.direct else "upstream"
      lines.append(f"  module {self.module} ({how})")
    if self.scope:
      lines.append(f"  name scope {self.scope}")
    if self.layers:
      lines.append(f"  layer {', '.join(map(str, self.layers))} (scan)")
    lines.append("What to do: " + self.advice())
    return "\n".join(lines)

  def _op_lines(self, scale: str) -> list:
    """The lines that name the op, its magnitudes and its source line."""
    dims = ",".join(map(str, self.shape))
    where = "  at no source line of yours (JAX's or fp16_scaling's own)"
    if self.filename:
      where = f"  at {self.source()} in {self.function}"
    return [
      f"First inf/NaN at loss scale {scale}, in the {self.kind} pass: "
      f"{self.primitive} -> {self.dtype}[{dims}]",
      f"  largest finite input {self.max_input:.4g} (float16's max is "
      f"{F16_MAX:g}); its output in float32: {self.float32_max:.4g}",
      where,
    ]


def described(origin: Any, scale: float) -> OverflowLocation:
  """The :class:`OverflowLocation` of an op ``origin`` (a ``_locator``
  origin: its equation, inputs, module and scan iterations)."""
  eqn = origin.eqn
  values = [i.value for i in origin.ins]
  back = any(i.back for i in origin.ins)
  module, direct, _ = module_of([i for i in origin.ins if floating(i.value)])
  finite_abs = [
    np.abs(x[np.isfinite(x)]) for x in map(np.asarray, values) if floating(x)
  ]
  calls = [p for p in origin.path if not isinstance(p, int)]
  frame = _user_frame([eqn, *reversed(calls)])
  try:
    widened = _widened_max(eqn, values)
  except Exception:  # a primitive that refuses float32: magnitude unknown
    widened = math.nan
  safe = None
  if back and 0 < widened < math.inf:
    safe = scale * 2.0 ** math.floor(math.log2(F16_MAX / widened))
  return OverflowLocation(
    kind="backward" if back else "forward",
    scale=scale,
    primitive=eqn.primitive.name,
    shape=tuple(origin.out.shape),
    dtype=jnp.dtype(origin.out.dtype).name,
    max_input=max((float(x.max()) for x in finite_abs if x.size), default=0),
    float32_max=widened,
    constant=origin.constant,
    filename=getattr(frame, "file_name", None),
    lineno=getattr(frame, "line_num", None),
    function=getattr(frame, "function_name", None),
    module="".join(module) if module else None,
    direct=direct,
    scope=_scope(eqn),
    layers=tuple(p for p in origin.path if isinstance(p, int)),
    safe_scale=safe,
  )


def _widened_max(eqn, values) -> float:
  """The largest ``|y|`` of ``eqn``'s floating outputs computed in float32
  from ``values`` (its float16 and bfloat16 ones widened, and a half dtype
  it is told to produce made float32): inf if float32 gives an inf or a
  NaN too."""
  wide = [
    x.astype(jnp.float32) if jnp.result_type(x) in _HALF else x for x in values
  ]
  params = {
    k: jnp.dtype(jnp.float32) if isinstance(v, np.dtype) and v in _HALF else v
    for k, v in eqn.params.items()
  }
  tops = [
    np.max(np.where(np.isnan(y), np.inf, np.abs(y)), initial=0)
    for y in bind(eqn, wide, params)
    if floating(y)
  ]
  return float(max(tops, default=0.0))


def _user_frame(eqns) -> Optional[Any]:
  """The innermost frame outside JAX, the frameworks, fp16_scaling and
  Python's own library in the traceback of the first of ``eqns`` that has
  one (an op, then the calls it lies in: the traceback of an op in a
  jitted library function ends where the function does), or None."""
  skip = library_roots()
  stdlib = sysconfig.get_paths()["stdlib"]
  tracebacks = [e.source_info.traceback for e in eqns]
  for tb in filter(None, tracebacks):
    for frame in tb.frames:
      name = frame.file_name
      python = name.startswith(stdlib) and "-packages" not in name
      if not python and not name.startswith(skip):
        return frame
  return None


def _scope(eqn) -> str:
  """``eqn``'s name stack (Flax, Haiku and Equinox modules, ``named_scope``)
  without the transformations (``jvp(...)``, ``transpose(...)``)."""
  names = re.sub(r"[\w.]*\(|\)", "", str(eqn.source_info.name_stack))
  return "/".join(n for n in names.split("/") if n)
