"""torch's ``DistributedDataParallel`` with GradScaler, one process per rank
(gloo, on CPU), for tests/peers/test_peer_ddp.py. No JAX here: each rank's
process imports only torch and numpy."""

import os

import numpy as np
import oracles  # its torch drivers import no JAX


def _weights(layer):
  """A torch ``Linear``'s weights, transposed to the JAX side's layout."""
  return layer.weight.detach().numpy().T.copy()


def _worker(rank, world, port, folder):
  """One DDP rank: the typical torch.amp recipe on its rows of each batch;
  rank 0 saves the scale and the weights after every step."""
  import torch
  import torch.distributed as dist

  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=world)
  data = np.load(os.path.join(folder, "data.npz"))
  net = oracles.torch_mlp(torch, data["hidden"], data["out"])
  ddp = torch.nn.parallel.DistributedDataParallel(net)
  opt = torch.optim.Adam(ddp.parameters(), lr=float(data["lr"]))
  scaler = torch.amp.GradScaler(
    "cpu", init_scale=float(data["init_scale"]), growth_interval=2
  )
  rows = len(data["x"][0]) // world
  mine = slice(rank * rows, (rank + 1) * rows)  # this rank's rows
  out = {"scale": [], "hidden": [], "out": []}
  for x, y in zip(data["x"], data["y"]):
    x = torch.tensor(x[mine])
    y = torch.tensor(y[mine])
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
      loss = torch.nn.functional.mse_loss(ddp(x)[:, 0], y)
    scaler.scale(loss).backward()  # DDP averages the gradients here
    scaler.step(opt)
    scaler.update()
    out["scale"].append(scaler.get_scale())
    out["hidden"].append(_weights(net[0]))
    out["out"].append(_weights(net[2]))
  if rank == 0:
    np.savez(os.path.join(folder, "torch.npz"), **out)
  dist.destroy_process_group()


def run(folder, world, port):
  """Runs ``world`` ranks on ``folder``'s data.npz; returns rank 0's record."""
  import torch.multiprocessing as mp

  mp.spawn(_worker, args=(world, port, folder), nprocs=world, join=True)
  return dict(np.load(os.path.join(folder, "torch.npz")))
