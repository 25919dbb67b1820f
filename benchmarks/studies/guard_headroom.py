"""How far ordinary training stays from the step guard's trust radius.

Trains a CIFAR-shaped WRN (``benchmarks/models.py``, narrowed for the CPU) on synthetic
32 × 32 images labelled by a fixed random linear teacher on 4 × 4-pooled pixels (balanced
classes, learnable but not trivially), with the paper's settings: FGD
on the "paper" selection with lr 0.2, momentum 0.9, feedback 0.4, SGD lr 0.1 and weight decay
5e-4 on the rest. Before every step it records, per orthogonal layer, the guard's radius
quantity ``r = ‖Φ‖_F + η‖g‖_F`` (what the safety radius compares with ρ) and after it the
distance ``‖θᵀθ − I‖_F`` (what the guard's rule keeps within ``max_distance``); it prints the
largest ``r``, ``r/ρ`` and distance over the run and the guard's counters
(``opt.guard_stats()``), which must be zero. ``--schedule`` ramps the lrs as a user would:
``onecycle`` (``OneCycleLR`` to the given lrs, momentum cycled 0.85–0.95) or ``cosine``.

    python -m benchmarks.studies.guard_headroom [--steps 150] [--width 1] [--depth 16] [--batch 64]
        [--schedule none|onecycle|cosine]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import fgd_fast
from benchmarks.machine import describe, environment
from benchmarks.models import wide_resnet
from benchmarks.studies import counts_checked
from fgd_fast.guards import TRUST_RADIUS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--width", type=float, default=1.0)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule", choices=("none", "onecycle", "cosine"), default="none")
    args = ap.parse_args(argv)
    counts_checked(ap, args, "steps")
    torch.manual_seed(args.seed)
    teacher = torch.randn(10, 3 * 4 * 4)
    net = wide_resnet(depth=args.depth, width=args.width)
    groups = fgd_fast.stiefel_param_groups(net, "paper")
    groups[0].update(lr=args.lr)
    groups[1].update(lr=0.1, weight_decay=5e-4)
    opt = fgd_fast.FGD(groups, lr=args.lr, momentum=0.9, feedback=0.4)
    orth = list(zip(groups[0]["names"], groups[0]["params"]))
    sched = None
    if args.schedule == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, 0.1], total_steps=args.steps)
    elif args.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    worst_r, worst_d, first_loss, t0 = (0.0, ""), (0.0, ""), None, time.time()
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32)
        y = (nn.functional.adaptive_avg_pool2d(x, 4).flatten(1) @ teacher.t()).argmax(1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        for name, p in orth:
            phi = opt.state.get(p, {}).get("momentum_buffer")
            eta = opt.param_groups[0]["lr"]
            r = (float(phi.norm()) if phi is not None else 0.0) + eta * float(p.grad.norm())
            worst_r = max(worst_r, (r, f"{name} at step {step}"))
        opt.step()
        if sched is not None:
            sched.step()
        for name, d in opt.orthogonality().items():
            worst_d = max(worst_d, (d, f"{name} at step {step}"))
        losses.append(float(loss.detach()))
        first_loss = first_loss if first_loss is not None else losses[0]
    stats = opt.guard_stats()
    bound = sum(v["scaled"] + v["reset"] for v in stats.values())
    print(f"{describe(environment(torch.device('cpu')))}; {time.time() - t0:.0f} s")
    print(
        f"WRN-{args.depth}-{args.width:g}, {len(orth)} orthogonal layers, {args.steps} steps of batch {args.batch}, "
        f"lr {args.lr} ({args.schedule} schedule), momentum 0.9, feedback 0.4"
    )
    tail = losses[-10:]  # (fewer in a run of fewer steps)
    print(f"loss: first {first_loss:.3f}, mean of the last {len(tail)} {sum(tail) / len(tail):.3f}")
    print(
        f"max r = ‖Φ‖ + η‖g‖: {worst_r[0]:.4g} ({worst_r[1]}); "
        f"r/ρ = {worst_r[0] / TRUST_RADIUS:.3g} (ρ = {TRUST_RADIUS})"
    )
    print(f"max ‖θᵀθ − I‖_F after a step: {worst_d[0]:.3g} ({worst_d[1]})")
    print(f"guard bound in {bound} layer-steps: {'OK' if bound == 0 else stats}")


if __name__ == "__main__":
    main()
