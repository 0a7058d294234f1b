"""The torch side of each recipe of docs/porting-torch.md, run against that
page: the page's blocks run first (docs_snippets.run_page), then each
recipe of PyTorch's "Automatic Mixed Precision examples" as torch's page
writes it, on CPU, with the page's weights and batches. At every step the
scale is torch's, bit for bit, the skips are torch's, and the parameters
are within the error bound of the two frameworks' float16 gradients
(tests/peers/fp16_bounds.py derives it; each test says its figures). The
page's GradScaler state is what torch's GradScaler returns and loads.

Tolerances: float16 roundings a gradient element passes through, R of
them, make the two frameworks' gradients differ by at most R * 2**-10 of
the absolute gradient (fp16_bounds); the optimizer carries that into the
parameters (SGD: lr times it, summed over the steps, with the loss's
curvature feeding it back; Adam: divided by the gradient's root mean
square, at most 2 B lr a step). A skipped step taken, or a step at the
wrong scale, moves the parameters by lr times a whole gradient, far above
each bound (asserted below).
"""

import docs_snippets
import fp16_bounds as fb
import numpy as np
import oracles
import pytest

torch = oracles.require("torch")

PAGE = "porting-torch.md"
R_MLP = 6  # x@W1, the ReLU'd h@w2, the cotangent's cast, dh, dW: 5 float16
# roundings, and the float32 sums' own error (32 terms: 32 * 2**-24 <
# 2**-11) as a sixth.
R_TWO = 9  # and 3 * out, the sum of the two outputs, 3 * cotangent.
R_PEN = 22  # the penalty's path: the forward (2), the first backward (3),
# its own backward (3), the norm and its backward (2), the unscale (1):
# 11, doubled, as a second derivative multiplies two rounded factors.


@pytest.fixture(scope="module")
def page():
  ns = {}
  ns["ran"] = docs_snippets.run_page(PAGE, ns)
  return ns


def test_the_page_runs(page):
  blocks = docs_snippets.blocks(PAGE)
  assert page["ran"] == len(blocks) == 12
  assert not any(docs_snippets.NEEDS.match(b) for b in blocks)


def torch_net(params):
  """The page's MLP in torch, with the same weights (torch's layout)."""
  kernels = (params[name]["kernel"] for name in ("hidden", "out"))
  return oracles.torch_mlp(torch, *kernels)


def torch_batch(page, i, bad=False):
  x, y = page["batch"](i, bad)
  return torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y))


def torch_loss(page, net, i, bad=False):
  x, y = torch_batch(page, i, bad)
  with torch.autocast("cpu", dtype=torch.float16):  # "cuda" on a GPU
    pred = net(x)[:, 0]
    return torch.nn.functional.mse_loss(pred, y)


def _kernel(layer):
  """A torch ``Linear``'s weights, in the JAX kernel's layout."""
  return layer.weight.detach().numpy().T.copy()


def weights(net):
  return {
    "hidden": {"kernel": _kernel(net[0])},
    "out": {"kernel": _kernel(net[2])},
  }


def _assert_below(diff, bound):
  """``diff <= bound`` elementwise; else the largest and its bound."""
  assert (diff <= bound).all(), (diff.max(), bound[diff.argmax()])


def assert_within(net, params, bound):
  """|torch's - ours| <= bound, elementwise (flat, fp16_bounds' order)."""
  _assert_below(fb.gap(weights(net), params), bound)


def one_net_bounds(page, params, i, bad, rounds, scale):
  """eps, the |Hessian| bound, and the float32 gradient, flat, of the
  page's mse at ``params`` on batch ``i``."""
  return fb.mlp_bounds(params, *page["batch"](i, bad), rounds, scale)


def before(run, params0, i):
  """The parameters at the start of step ``i`` of ``run``."""
  if i == 0:
    return params0
  return run[i - 1][0]


def one_net(page, key, optimizer):
  """The page's run ``key``, params0, torch's net, optimizer and scaler."""
  run = page[key]
  p0 = page["params0"]
  net = torch_net(p0)
  scaler = torch.amp.GradScaler("cpu", **page["scaler_args"])
  opt = optimizer(net.parameters(), lr=1e-2)
  return run, p0, net, opt, scaler


def bounds_before(page, run, p0, i):
  """one_net_bounds of clean step ``i`` at its start's params and scale."""
  if i == 0:
    scale = 2.0**10
  else:
    scale = float(run[i - 1][1]["loss_scale"])
  return one_net_bounds(page, before(run, p0, i), i, False, R_MLP, scale)


def test_typical(page):
  # torch: scaler.scale(loss).backward(); scaler.step; scaler.update.
  run, p0, net, optimizer, scaler = one_net(page, "amp_run", torch.optim.Adam)
  steps = []  # per applied step, what adam_step_bounds takes
  bounds = []
  for i, (params, m) in enumerate(run):
    d = fb.gap(weights(net), before(run, p0, i))
    optimizer.zero_grad()
    loss = torch_loss(page, net, i, bad=i == 3)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == float(m["loss_scale"])
    if i != 3:  # the skipped step: neither moves
      eps, hess, g = bounds_before(page, run, p0, i)
      steps.append((d, eps, hess, fb.flat(params), g))
      bounds = fb.adam_step_bounds(steps, 1e-2)
    else:
      bounds.append(d)
    assert_within(net, params, bounds[-1])
  assert optimizer.state[net[0].weight]["step"] == 5  # one step skipped
  # The bound is not loose enough to hide a step: Adam moves each
  # parameter by about lr a step; most of the bound is far below.
  assert np.median(bounds[-1]) < 1e-3


def test_clipping(page):
  # torch: scaler.unscale_(optimizer); clip_grad_norm_(..., 1.0).
  run, p0, net, optimizer, scaler = one_net(page, "clip_run", torch.optim.SGD)
  for i, (params, m) in enumerate(run):
    d = fb.gap(weights(net), before(run, p0, i))
    optimizer.zero_grad()
    loss = torch_loss(page, net, i, bad=i == 3)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == float(m["loss_scale"])
    if i == 3:
      assert not np.isfinite(norm.item())
    else:
      eps, hess, g = bounds_before(page, run, p0, i)
      e = eps + hess @ d  # each run's gradient at its own parameters
      e2 = float(np.linalg.norm(e))
      # |norm' - norm| <= |g' - g|_2 <= |e|_2, and the float32 sums of
      # squares, 288 terms: 288 * 2**-24 relative.
      gn = float(m["grad_norm"])
      sums = 288 * 2.0**-24 * gn
      assert abs(norm.item() - gn) <= e2 + sums
      # Clipping to the unit ball: g / |g| moves by at most
      # e / |g'| + |g| |e|_2 / (|g| |g'|), |g'| >= |g| - |e|_2 > 1.
      low = gn - e2
      assert low > 1
      du = (e + (np.abs(g) + e) * e2 / gn) / low
      d = d + 1e-2 * du + fb.update_roundings(params)
    assert_within(net, params, d)
  # A step missed or taken twice moves by lr * 1.0 in norm: 4 times this.
  assert np.linalg.norm(d) < 1e-2 / 4


def test_accumulation(page):
  # torch: loss / iters_to_accumulate; step and update once a window.
  run, p0, net, optimizer, scaler = one_net(page, "accum_run", torch.optim.SGD)
  iters_to_accumulate = 4
  # The 1st window, all at params0 (torch's backward at 2**10 / 4).
  window = [
    one_net_bounds(page, p0, i, False, R_MLP, 2.0**10 / 4) for i in range(4)
  ]
  eps = sum(eps_i for eps_i, _, _ in window) / 4
  # The float32 mean of 4 and the update: a few float32 roundings.
  d = 1e-2 * eps + 2 * fb.update_roundings(run[3][0])
  checked = 0
  for i, (params, m) in enumerate(run):
    loss = torch_loss(page, net, i, bad=i == 5) / iters_to_accumulate
    scaler.scale(loss).backward()
    if (i + 1) % iters_to_accumulate == 0:
      scaler.step(optimizer)
      scaler.update()
      optimizer.zero_grad()
      assert scaler.get_scale() == float(m["loss_scale"])
      assert_within(net, params, d)  # the 2nd window skipped: the same d
      checked += 1
  assert checked == 2
  moved = fb.gap(run[3][0], p0).max()
  assert d.max() < moved / 10  # the window's step is 10 times the bound


def test_gradient_penalty(page):
  # torch: autograd.grad(scaled loss, create_graph=True), unscale by hand,
  # add the gradients' norm, backward of the scaled sum.
  run, p0, net, optimizer, scaler = one_net(page, "pen_run", torch.optim.SGD)
  for i, (params, m) in enumerate(run):
    d = fb.gap(weights(net), before(run, p0, i))
    optimizer.zero_grad()
    loss = torch_loss(page, net, i, bad=i == 3)
    scaled_loss = scaler.scale(loss)
    scaled_grads = torch.autograd.grad(
      scaled_loss, net.parameters(), create_graph=True
    )
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    with torch.autocast("cpu", dtype=torch.float16):
      penalty = sum(g.pow(2).sum() for g in grads).sqrt()
      loss = loss + penalty
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == float(m["loss_scale"])
    if i != 3:
      eps, hess, g = bounds_before(page, run, p0, i)
      # The penalty's gradient H g / |g|: its terms are bounded by
      # H_abs @ G / |g| (G the absolute gradient); R_PEN roundings of it.
      big_g = eps / R_MLP * 2.0**10
      gn = float(np.linalg.norm(g))
      e = eps + R_PEN * 2.0**-10 * (hess @ big_g) / gn
      # Feedback: the penalized loss's curvature, H and the penalty's
      # own, H_abs @ H_abs / |g| to first order.
      feedback = hess @ d + hess @ (hess @ d) / gn
      d = d + 1e-2 * (e + feedback)
      d = d + fb.update_roundings(params)
    assert_within(net, params, d)
  # Loose: the absolute second-order terms bound a rounding of H g / |g|
  # by |H| |g| / |g| summed without cancellation; below the run's move.
  moved = fb.gap(run[-1][0], p0).max()
  assert d.max() < moved / 2


def torch_losses(page, nets, i, bad=False):
  x, y = torch_batch(page, i, bad)
  with torch.autocast("cpu", dtype=torch.float16):
    out0, out1 = (net(x)[:, 0] for net in nets)
    return (
      torch.nn.functional.mse_loss(2 * out0 + 3 * out1, y),
      torch.nn.functional.mse_loss(3 * out0 - 5 * out1, y),
    )


def two_net_bounds(page, p0, p1, losses, scale, which=(0, 1)):
  """eps for both nets (flat, joint), from the losses ``(coeffs, i, bad)``
  each differentiated for the nets in ``which``; and the joint |Hessian|."""
  eps = []
  for j in (0, 1):
    total = np.zeros(fb.flat(p0).size)
    for k, (coeffs, i, bad) in enumerate(losses):
      if which[k] not in (j, None):
        continue
      x, y = page["batch"](i, bad)
      abs_grads = fb.abs_grad([p0, p1], [(coeffs, x, y)])
      total = total + fb.flat(abs_grads[j])
      # A subnormal result's absolute rounding, as fp16_bounds.mlp_bounds.
      largest = float(np.abs(x).max())
      subnormal = 8 * largest * 2.0**-25 / scale
      total = total + subnormal
    eps.append(R_TWO * 2.0**-10 * total)
  data = [(c, *page["batch"](i, bad)) for c, i, bad in losses]
  hess = fb.abs_hessian([p0, p1], data)
  return np.concatenate(eps), hess


def _flat2(p0, p1):
  return np.concatenate([fb.flat(p0), fb.flat(p1)])


def _two_flat(net0, net1):
  return _flat2(weights(net0), weights(net1))


def _two_gap(nets, p0, p1):
  """``|torch's - ours|`` of both nets, elementwise, flat."""
  return np.abs(_two_flat(*nets) - _flat2(p0, p1))


def _check_two(nets, r, d):
  _assert_below(_two_gap(nets, r[0], r[1]), d)


def two_nets(page):
  """torch's two nets (params0, params1), their SGDs and one GradScaler."""
  nets = torch_net(page["params0"]), torch_net(page["params1"])
  opt0 = torch.optim.SGD(nets[0].parameters(), lr=1e-3)
  opt1 = torch.optim.SGD(nets[1].parameters(), lr=1e-3)
  scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6, growth_interval=2)
  return nets, opt0, opt1, scaler


def _two_before(page, run, i, scale_at):
  """Both nets' parameters and the loss scale at the start of step ``i`` of
  ``run``, whose records hold the scale's state at ``scale_at``."""
  if i == 0:
    return page["params0"], page["params1"], 2.0**6
  q0, q1 = run[i - 1][:2]
  scale = float(page["fs"].current_scale(run[i - 1][scale_at]))
  return q0, q1, scale


def test_two_models_one_scaler(page):
  # torch: two backward passes, scaler.step(opt0), scaler.step(opt1), one
  # scaler.update().
  two = page["two"]
  nets, opt0, opt1, scaler = two_nets(page)
  current = page["fs"].current_scale
  for i, r in enumerate(two):
    q0, q1, scale = _two_before(page, two, i, scale_at=2)
    d = _two_gap(nets, q0, q1)
    opt0.zero_grad()
    opt1.zero_grad()
    loss0, loss1 = torch_losses(page, nets, i, bad=i == 2)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.step(opt0)
    scaler.step(opt1)
    scaler.update()
    assert scaler.get_scale() == float(current(r[2]))
    if i != 2:
      losses = [((2.0, 3.0), i, False), ((3.0, -5.0), i, False)]
      eps, hess = two_net_bounds(page, q0, q1, losses, scale, (None, None))
      d = d + 1e-3 * (eps + hess @ d)
      d = d + fb.update_roundings((r[0], r[1]))
    _check_two(nets, r, d)
  step = fb.gap(two[1][0], two[0][0]).max()
  assert d.max() < step  # below one step's move


def test_gan_order(page):
  # The 2nd loss after the 1st optimizer stepped; model 1's gradients
  # zeroed before its backward, as fake.detach() does.
  gan = page["gan"]
  nets, opt0, opt1, scaler = two_nets(page)
  current = page["fs"].current_scale
  for i, r in enumerate(gan):
    q0, q1, scale = _two_before(page, gan, i, scale_at=3)
    d = _two_gap(nets, q0, q1)
    opt0.zero_grad()
    opt1.zero_grad()
    loss0 = torch_losses(page, nets, i)[0]
    scaler.scale(loss0).backward()
    scaler.step(opt0)
    opt1.zero_grad()
    loss1 = torch_losses(page, nets, 10 + i, bad=i == 2)[1]
    scaler.scale(loss1).backward()
    scaler.step(opt1)
    scaler.update()
    assert scaler.get_scale() == float(current(r[2]))
    # Model 0 always steps; model 1 skips step 2. Loss 1 is taken with the
    # stepped model 0 (r[0]); to first order in lr its |Hessian| is the
    # one before the step.
    losses = [((2.0, 3.0), i, False)]
    if i != 2:
      losses.append(((3.0, -5.0), 10 + i, False))
    eps, hess = two_net_bounds(page, q0, q1, losses, scale, (0, 1))
    if i == 2:
      half = eps.size // 2
      eps[half:] = 0.0
      hess[half:] = 0.0  # model 1 does not move
    d = d + 1e-3 * (eps + hess @ d)
    d = d + fb.update_roundings((r[0], r[1]))
    _check_two(nets, r, d)
  step = fb.gap(gan[1][0], gan[0][0]).max()
  assert d.max() < step  # below one step's move


def test_grad_scaler_state(page):
  gs = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=500)
  assert gs.state_dict() == page["torch_sd"]  # the page's literal is torch's
  gs = torch.amp.GradScaler("cpu")
  gs.load_state_dict(page["back"])
  assert gs.get_scale() == 2.0**14
  assert gs.state_dict() == page["torch_sd"]
