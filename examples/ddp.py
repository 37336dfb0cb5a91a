"""Trains a small MLP with DistributedDataParallel on openreg devices, one device per rank.

    torchrun --nproc-per-node 2 examples/ddp.py [--steps 100] [--timeout SECONDS]

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the process group, made
without a backend name as on CUDA, gets the `occl` backend for openreg tensors and gloo for CPU
tensors (torch_openreg/distributed.py, docs/distributed.md). Each
rank trains on its own shard of a synthetic regression problem; DDP averages the gradients.
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a collective may wait for the other ranks (default: torch's)")
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("openreg", local_rank % torch.openreg.device_count())
    torch.openreg.set_device(device)
    # "cpu:gloo,openreg:occl". With a timeout, a rank whose peer is stuck fails instead of
    # waiting forever, and torchrun ends the job (docs/fault_injection.md).
    timeout = None if args.timeout is None else datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(device_id=device, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank}/{world} on {device}", flush=True)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    for step in range(args.steps):
        x = torch.randn(32, 16, generator=g)
        y = x @ w_true
        loss = F.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {loss.item():.4f}", flush=True)

    # DDP keeps the replicas identical: compare every rank's weights with rank 0's
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.tensor([int(torch.equal(flat, ref))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"replicas identical: {bool(same.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
