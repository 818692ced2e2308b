"""The CIFAR-10 ResNet of He et al. (2016, section 4.2), for tests with real weights.

Module names match the checkpoints in ``shared/data/weights`` once their ``module.``
prefix is stripped. Input: float32 [N, 3, 32, 32] normalised with the ImageNet mean/std;
output: logits [N, num_classes].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DownsampleA(nn.Module):
    """Shortcut "option A": subsample by 2 and zero-pad the channels; no parameters."""

    def __init__(self, pad: int) -> None:
        super().__init__()
        self.pad = pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.pad pads the last dimensions first: (W, W, H, H, C, C).
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        if stride == 1 and in_planes == planes:
            self.shortcut: nn.Module = nn.Identity()
        else:
            self.shortcut = DownsampleA(planes // 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """6n+2 layers: a stem conv, three stages of n basic blocks (16, 32, 64 channels)."""

    def __init__(self, n: int, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._stage(16, 16, n, stride=1)
        self.layer2 = self._stage(16, 32, n, stride=2)
        self.layer3 = self._stage(32, 64, n, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    @staticmethod
    def _stage(in_planes: int, planes: int, n: int, stride: int) -> nn.Sequential:
        blocks = [BasicBlock(in_planes, planes, stride)]
        blocks += [BasicBlock(planes, planes) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.linear(torch.flatten(self.avgpool(x), 1))


def resnet20(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(3, num_classes)


def resnet56(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(9, num_classes)
