"""The data sets of ``benchmarks/training/train.py`` (one concern: images and labels, in batches).

* ``digits``: scikit-learn's bundled 8×8 handwritten digits (1,797 images, 10 classes; real
  data, installed with scikit-learn, no download), split 80/20 stratified with a fixed seed.
* ``cifar10``: CIFAR-10 from ``DIR/cifar-10-batches-py`` (the python-pickle batches that
  ``torchvision.datasets.CIFAR10(DIR, download=True)`` leaves on disk; read directly, so
  torchvision is not needed), with the usual 4-pixel-pad random crop and horizontal flip.
* ``synthetic``: CIFAR-shaped random images (3×32×32) whose labels a fixed random linear
  "teacher" on 8×8-pooled pixels assigns: learnable, cheap, and made on the device, for
  timing the training step without a data set.

Every set lives on the training device as whole tensors; batches are drawn with a
``torch.Generator`` so each optimizer of a comparison sees the same batches in the same order.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["DATASETS", "Dataset", "load_dataset"]

DATASETS = ("digits", "cifar10", "synthetic")
CIFAR_MEAN = (125.3, 123.0, 113.9)  # per-channel pixel mean and std of the CIFAR-10 training set
CIFAR_STD = (63.0, 62.1, 66.7)


@dataclass
class Dataset:
    name: str
    description: str
    train_x: torch.Tensor  # (N, C, H, W): float32 already normalised, or uint8 (normalised per batch)
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    augment: bool = False  # random crop (pad 4) + horizontal flip of every training batch
    mean: torch.Tensor | None = None  # (1, C, 1, 1) for uint8 images
    std: torch.Tensor | None = None

    @property
    def in_channels(self) -> int:
        return self.train_x.shape[1]

    def steps_per_epoch(self, batch_size: int) -> int:
        return math.ceil(len(self.train_y) / batch_size)

    def _prepare(self, x: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
        if self.mean is not None:
            x = (x.float() - self.mean) / self.std
        return x.contiguous(memory_format=memory_format)

    def train_batches(
        self,
        batch_size: int,
        steps: int,
        generator: torch.Generator,
        memory_format=torch.contiguous_format,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` batches: shuffled passes over the training set (a new permutation each pass)."""
        n, order, at = len(self.train_y), torch.empty(0, dtype=torch.long), 0
        for _ in range(steps):
            if at >= len(order):
                order, at = torch.randperm(n, generator=generator), 0
            idx = order[at : at + batch_size].to(self.train_x.device)
            at += batch_size
            x, y = self.train_x[idx], self.train_y[idx]
            if self.augment:
                x = _crop_and_flip(x, generator)
            yield self._prepare(x, memory_format), y

    def test_batches(self, batch_size: int, memory_format=torch.contiguous_format):
        for i in range(0, len(self.test_y), batch_size):
            yield self._prepare(self.test_x[i : i + batch_size], memory_format), self.test_y[i : i + batch_size]


def _crop_and_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Per image: a random ``H × W`` crop of the image padded by ``pad`` (zeros), flipped
    left-right with probability ½."""
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b, 1), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (b, 1), generator=generator).to(x.device)
    flip = (torch.rand(b, 1, generator=generator) < 0.5).to(x.device)
    rows = torch.arange(h, device=x.device) + dy  # (b, h)
    cols = torch.arange(w, device=x.device)
    cols = torch.where(flip, w - 1 - cols, cols) + dx  # (b, w)
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, chan, rows[:, None, :, None], cols[:, None, None, :]]


def _digits(device: torch.device, seed: int) -> Dataset:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise SystemExit(
            f"--dataset digits needs scikit-learn ({exc}): pip install 'fgd_fast[examples]' or pip install scikit-learn"
        ) from exc
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (1797, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    tr, te = train_test_split(range(len(y)), test_size=0.2, stratify=digits.target, random_state=seed)
    tr, te = torch.tensor(tr), torch.tensor(te)
    mean, std = x[tr].mean(), x[tr].std()
    x = (x - mean) / std
    return Dataset(
        "digits",
        f"scikit-learn digits, 8×8 grey, {len(tr)} train / {len(te)} test images",
        x[tr].to(device),
        y[tr].to(device),
        x[te].to(device),
        y[te].to(device),
        num_classes=10,
    )


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="latin1")


def _cifar10(data_dir: str | None, device: torch.device) -> Dataset:
    if not data_dir:
        raise SystemExit("--dataset cifar10 needs --data-dir DIR (the folder that holds cifar-10-batches-py/)")
    root = Path(data_dir)
    root = root if root.name == "cifar-10-batches-py" else root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise SystemExit(
            f"--dataset cifar10: {root} lacks {', '.join(missing)}; it must hold the python-pickle batches of "
            "CIFAR-10 (as torchvision.datasets.CIFAR10(DIR, download=True) leaves them)"
        )
    batches = [_unpickle(root / n) for n in names]

    def stack(parts):
        x = torch.cat([torch.as_tensor(b["data"]).view(-1, 3, 32, 32) for b in parts])
        y = torch.cat([torch.as_tensor(b["labels"], dtype=torch.long) for b in parts])
        return x.to(device), y.to(device)

    (trx, tr_y), (tex, te_y) = stack(batches[:5]), stack(batches[5:])
    shape = (1, 3, 1, 1)
    return Dataset(
        "cifar10",
        f"CIFAR-10 from {root}, {len(tr_y)} train / {len(te_y)} test images, crop + flip",
        trx,
        tr_y,
        tex,
        te_y,
        num_classes=10,
        augment=True,
        mean=torch.tensor(CIFAR_MEAN, device=device).view(shape),
        std=torch.tensor(CIFAR_STD, device=device).view(shape),
    )


def _synthetic(device: torch.device, seed: int, train_size: int, test_size: int = 1024) -> Dataset:
    gen = torch.Generator(device=device).manual_seed(seed)
    teacher = torch.randn(3 * 4 * 4, 10, device=device, generator=gen)

    def make(count):
        x = torch.randn(count, 3, 32, 32, device=device, generator=gen)
        y = (torch.nn.functional.avg_pool2d(x, 8).flatten(1) @ teacher).argmax(1)  # learnable labels
        return x, y

    (trx, tr_y), (tex, te_y) = make(train_size), make(test_size)
    return Dataset(
        "synthetic",
        f"random CIFAR-shaped images (3×32×32) with teacher labels, {train_size} train / {test_size} test",
        trx,
        tr_y,
        tex,
        te_y,
        num_classes=10,
    )


def load_dataset(
    name: str, device: torch.device, *, data_dir: str | None = None, seed: int = 0, synthetic_size: int = 4096
) -> Dataset:
    if name == "digits":
        return _digits(device, seed)
    if name == "cifar10":
        return _cifar10(data_dir, device)
    if name == "synthetic":
        return _synthetic(device, seed, synthetic_size)
    raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
