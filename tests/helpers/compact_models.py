"""Small models used by the compaction tests and benchmark (defined here, no downloads)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNetLike(nn.Module):
    """ResNet-18-like (``bottleneck=False``, blocks 2-2-2-2) or ResNet-50-like (3-4-6-3 bottlenecks).

    ``widths``: output channels per stage; ``mids``: inner width per stage (defaults:
    the stage width, or a quarter of it for bottlenecks).
    """

    def __init__(
        self,
        widths: Sequence[int] = (16, 32, 64, 128),
        mids: Optional[Sequence[int]] = None,
        bottleneck: bool = False,
        blocks: Optional[Sequence[int]] = None,
        num_classes: int = 10,
        stem: Optional[int] = None,
    ) -> None:
        super().__init__()
        blocks = blocks or ((3, 4, 6, 3) if bottleneck else (2, 2, 2, 2))
        mids = mids or [w // 4 if bottleneck else w for w in widths]
        stem = stem or (widths[0] if not bottleneck else widths[0] // 4 * 1 or widths[0])
        self.conv1 = nn.Conv2d(3, stem, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.pool = nn.MaxPool2d(2)
        block = Bottleneck if bottleneck else BasicBlock
        layers = []
        cin = stem
        for i, (w, m, n) in enumerate(zip(widths, mids, blocks)):
            stage = []
            for j in range(n):
                stage.append(block(cin, m, w, stride=2 if (j == 0 and i > 0) else 1))
                cin = w
            layers.append(nn.Sequential(*stage))
        self.layers = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.layers(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class MLP(nn.Module):
    def __init__(self, sizes: Sequence[int] = (64, 128, 96, 10)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nn.functional.gelu(x)
        return x


class DWSeparable(nn.Module):
    """MobileNet-v1-like: depthwise 3x3 + pointwise 1x1 blocks, GroupNorm in one place."""

    def __init__(self, widths: Sequence[int] = (16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 2, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks = []
        cin = widths[0]
        for w in widths[1:]:
            blocks += [
                nn.Conv2d(cin, cin, 3, 1, 1, groups=cin, bias=False),
                nn.BatchNorm2d(cin),
                nn.ReLU6(),
                nn.Conv2d(cin, w, 1, bias=False),
                nn.GroupNorm(w // 4, w),
                nn.Hardswish(),
            ]
            cin = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block with nn.MultiheadAttention, plus an embedding."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, ff: int = 64, seq_first: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=not seq_first)
        self.norm2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)
        self.seq_first = seq_first

    def forward(self, ids, key_padding_mask=None):
        x = self.emb(ids)
        if self.seq_first:
            x = x.transpose(0, 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        x = x + self.ff2(torch.relu(self.ff1(self.norm2(x))))
        return x
