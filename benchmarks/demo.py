"""A short CPU demo: train a small CNN on synthetic data with FGD and print loss and
orthogonality (‖θᵀθ − I‖_F of every orthogonal layer) as it goes."""
from __future__ import annotations

import argparse

import torch
from torch import nn

import fgd_fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backend", default="auto", choices=fgd_fast.BACKENDS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    torch.manual_seed(0)
    block = lambda i, o: [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]  # noqa: E731
    net = nn.Sequential(*block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).to(args.device)
    teacher = nn.Sequential(nn.AvgPool2d(8), nn.Flatten(), nn.Linear(3 * 2 * 2, 10)).to(args.device)  # labels to learn
    groups = fgd_fast.stiefel_param_groups(net, rule="paper")
    opt = fgd_fast.FGD(groups, lr=0.05, momentum=0.9, feedback=0.4, weight_decay=5e-4, backend=args.backend)
    print(f"fgd_fast {fgd_fast.__version__} | torch {torch.__version__} | device {args.device} | backend {opt.resolved_backend(args.device)}")
    print(f"orthogonal layers: {', '.join(groups[0]['names'])}")
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 3, 16, 16, device=args.device)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == 1:
            dist = opt.orthogonality()
            print(f"step {step:4d}  loss {loss.item():.4f}  max ‖θᵀθ − I‖_F {max(dist.values()):.2e}")


if __name__ == "__main__":
    main()
