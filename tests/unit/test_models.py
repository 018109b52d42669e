"""Models: shapes for every MODELS entry and both stems, Goyal's initialisation, Normalize, the MAC counter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from largebatch.errors import UserError
from largebatch.models import MODELS, Normalize, build_model, count_flops, count_macs
from largebatch.models.resnet import BasicBlock, Bottleneck

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def resnet50() -> nn.Module:
    torch.manual_seed(0)
    return build_model("resnet50", num_classes=1000)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_output_shapes_both_stems(name: str) -> None:
    torch.manual_seed(0)
    small = build_model(name, num_classes=7, in_channels=1, stem="small", width=4).eval()
    for size in (28, 32):
        out = small(torch.randn(2, 1, size, size))
        assert out.shape == (2, 7) and torch.isfinite(out).all()
    big = build_model(name, num_classes=5, in_channels=3, stem="imagenet", width=4).train()
    out = big(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 5)
    out.sum().backward()
    assert all(p.grad is not None for p in big.parameters())


def test_torchvision_parameter_counts(resnet50: nn.Module) -> None:
    # The well-known torchvision totals: same layers, same shapes.
    assert sum(p.numel() for p in resnet50.parameters()) == 25_557_032
    assert sum(p.numel() for p in build_model("resnet18", 1000).parameters()) == 11_689_512


def test_resnet50_macs_match_the_literature(resnet50: nn.Module) -> None:
    # "ResNet-50 forward at 224x224 is about 4.1 GFLOPs" (He et al.) -- that figure counts multiply-adds.
    # count_macs gives MACs; count_flops gives 2 x MACs (hardware FLOPs, for MFU).
    macs = count_macs(resnet50, (1, 3, 224, 224))
    assert abs(macs - 4.1e9) / 4.1e9 < 0.03, macs
    assert count_flops(resnet50, (1, 3, 224, 224)) == 2 * macs
    assert count_macs(resnet50, (4, 3, 224, 224)) == 4 * macs


def test_mac_counter_exact_on_a_tiny_model() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(18, 4))
    model.train()
    before = [t.clone() for t in model.state_dict().values()]
    # conv: 2 x 3 x 3 outputs x (1 x 3 x 3) MACs each = 162; linear: 4 outputs x 18 = 72.
    assert count_macs(model, (1, 1, 5, 5)) == 162 + 72
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))


def test_zero_init_residual_is_switchable() -> None:
    for name, block in (("resnet18", BasicBlock), ("resnet50", Bottleneck)):
        for zero in (True, False):
            model = build_model(name, 10, stem="small", width=8, zero_init_residual=zero)
            blocks = [m for m in model.modules() if isinstance(m, block)]
            assert len(blocks) == (8 if name == "resnet18" else 16)
            for b in blocks:
                expected = 0.0 if zero else 1.0
                assert torch.all(b.last_bn.weight == expected)
                if b.shortcut is not None:  # the shortcut BN is never zeroed
                    assert torch.all(b.shortcut[1].weight == 1.0)
            # every other BN: gamma 1, beta 0
            last = {id(b.last_bn) for b in blocks}
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    assert torch.all(m.bias == 0)
                    if id(m) not in last:
                        assert torch.all(m.weight == 1)


def test_goyal_initialisation(resnet50: nn.Module) -> None:
    fc = resnet50.fc
    assert abs(fc.weight.std().item() - 0.01) < 0.0005 and abs(fc.weight.mean().item()) < 0.0005
    assert torch.all(fc.bias == 0)
    conv = resnet50.layer4[0].conv2  # 512 -> 512, 3x3: He fan_out std = sqrt(2 / (512 * 9))
    assert abs(conv.weight.std().item() / (2 / (512 * 9)) ** 0.5 - 1) < 0.02


def test_normalize_uint8_matches_manual_and_keeps_channels_last() -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    norm = Normalize(mean, std)
    x = torch.randint(0, 256, (2, 3, 5, 6), dtype=torch.uint8)
    manual = (x.double() / 255 - torch.tensor(mean).view(1, 3, 1, 1).double()) / torch.tensor(std).view(1, 3, 1, 1).double()
    y = norm(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), manual, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm(x.float() / 255).double(), manual, rtol=1e-5, atol=1e-5)
    y_cl = norm(x.contiguous(memory_format=torch.channels_last))
    assert y_cl.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y_cl, y)
    assert "scale" not in norm.state_dict()  # constants are not checkpointed
    with pytest.raises(ValueError):
        norm(torch.zeros(1, 1, 4, 4, dtype=torch.uint8))


def test_unknown_model_is_a_user_error_listing_the_names() -> None:
    with pytest.raises(UserError) as err:
        build_model("resnet51", 10)
    assert all(name in str(err.value) for name in MODELS)
    with pytest.raises(UserError):
        build_model("resnet18", 10, stem="tiny")
