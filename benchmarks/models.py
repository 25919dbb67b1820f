"""Real model definitions whose weight shapes the benchmarks use (no torchvision needed).

* ``wide_resnet(depth=28, width=10)``: WRN-28-10 of Zagoruyko & Komodakis (CIFAR stem);
* ``resnet50()``: the bottleneck ResNet-50 (ImageNet stem), ``width`` scales every channel;
* ``vgg16()``: VGG-16 (configuration D), with ``width`` scaling;
* ``transformer(layers=12, d_model=768)``: pre-norm blocks with separate q, k, v, o
  projections and a 4× MLP;
* ``cifar_resnet(depth=18)``: ResNet-18/34 with basic blocks and the CIFAR stem (3×3 conv,
  no max-pool), as trained on 32×32 images;
* ``small_cnn()``: four 3×3 conv layers with batch norm for small images (the 8×8 digits of
  ``benchmarks/training/train.py``).

Every constructor takes a ``width`` multiplier so CPU runs can use the same structure, narrower.
"""

from __future__ import annotations

from torch import nn


def _c(ch: float) -> int:
    return max(1, int(round(ch)))


class _WideBasic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.conv2 = nn.BatchNorm2d(cout), nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        o = self.conv1(nn.functional.relu(self.bn1(x)))
        o = self.conv2(nn.functional.relu(self.bn2(o)))
        return o + self.shortcut(x)


def wide_resnet(depth: int = 28, width: float = 10, num_classes: int = 10) -> nn.Module:
    """WRN-depth-width; ``width`` may be fractional for narrowed CPU variants."""
    blocks = (depth - 4) // 6
    widths = [_c(16 * width), _c(32 * width), _c(64 * width)]
    layers, cin = [nn.Conv2d(3, 16, 3, 1, 1, bias=False)], 16
    for stage, cout in enumerate(widths):
        for b in range(blocks):
            layers.append(_WideBasic(cin, cout, 2 if (stage > 0 and b == 0) else 1))
            cin = cout
    layers += [nn.BatchNorm2d(cin), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        o = nn.functional.relu(self.bn1(self.conv1(x)))
        return nn.functional.relu(self.bn2(self.conv2(o)) + self.down(x))


def cifar_resnet(depth: int = 18, width: float = 1.0, num_classes: int = 10) -> nn.Module:
    """ResNet-18 or -34 (basic blocks) with the CIFAR stem: a 3×3 stride-1 conv, no max-pool."""
    counts = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}.get(depth)
    if counts is None:
        raise ValueError(f"cifar_resnet: depth={depth} is not one of 18, 34")
    stem = _c(64 * width)
    layers, cin = [nn.Conv2d(3, stem, 3, 1, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU()], stem
    for i, (count, cout) in enumerate(zip(counts, (64, 128, 256, 512))):
        cout = _c(cout * width)
        for b in range(count):
            layers.append(_Basic(cin, cout, 2 if (i > 0 and b == 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def small_cnn(in_channels: int = 1, width: float = 1.0, num_classes: int = 10) -> nn.Module:
    """Four 3×3 conv + batch-norm + ReLU layers (32, 64, 64, 128 channels at ``width=1``), one
    2×2 max-pool after the second, global average pooling and a linear classifier. Under the
    ``"paper"`` rule every conv but the first (whose c_i·k1·k2 = 9 < 32) is constrained."""
    chans = [_c(c * width) for c in (32, 64, 64, 128)]
    layers, cin = [], in_channels
    for i, cout in enumerate(chans):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        if i == 1:
            layers.append(nn.MaxPool2d(2))
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = 4 * mid
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x):
        o = nn.functional.relu(self.bn1(self.conv1(x)))
        o = nn.functional.relu(self.bn2(self.conv2(o)))
        return nn.functional.relu(self.bn3(self.conv3(o)) + self.down(x))


def resnet50(width: float = 1.0, num_classes: int = 1000) -> nn.Module:
    stem = _c(64 * width)
    layers = [nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = stem
    for i, (count, mid) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        mid = _c(mid * width)
        for b in range(count):
            layers.append(_Bottleneck(cin, mid, 2 if (i > 0 and b == 0) else 1))
            cin = 4 * mid
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def vgg16(width: float = 1.0, num_classes: int = 1000) -> nn.Module:
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers, cin = [], 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            cout = _c(v * width)
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        split = lambda z: z.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = nn.functional.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def transformer(layers: int = 12, d_model: int = 768, heads: int = 12, width: float = 1.0) -> nn.Module:
    d = _c(d_model * width)
    heads = max(1, min(heads, d // 8)) if d % heads else heads
    return nn.Sequential(*[_Block(d, heads) for _ in range(layers)])
