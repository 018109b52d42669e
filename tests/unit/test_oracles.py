"""Oracles: largebatch's pieces against the implementations most users run, torchvision's and timm's.

1. `resnet18`/`resnet50` against torchvision's: the parameter count, a state-dict mapping of every tensor, the
   initialisation tensor by tensor (zero-init of the residual gammas included), and the outputs bit for bit from
   the same weights, in eval mode and in train mode; the `Normalize` first layer against torchvision's
   ToDtype + Normalize within float32 rounding.
2. `largebatch.optim.LARS` against `timm.optim.Lars` and `LAMB` against `timm.optim.Lamb`: 30 steps in float64 of
   a small ResNet with a warm-up and a poly decay, largebatch's parameter groups (`build_optimizer`, as a run
   builds them) against timm's own (`param_groups_weight_decay`). Each documented difference
   (docs/models_optim.md, "Tested against") is set explicitly below.
3. The JPEG crop (largebatch/data/jpeg.py: the box, DCT-scaled decoding, the resize, the flip) against torchvision's
   RandomResizedCrop + RandomHorizontalFlip of the image torchvision decodes at full size, at the same box.

Marked `oracle`; `make test-eco` runs them in its environment (torch 2.14.1, torchvision 0.29.1, timm), where a
library that does not import is a failure (LARGEBATCH_REQUIRE_LIBRARIES=1); elsewhere they skip.
"""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import require_library
from PIL import Image
from torch import nn

from largebatch.config import OptimConfig
from largebatch.data import jpeg
from largebatch.models import Normalize, build_model
from largebatch.optim import build_optimizer
from largebatch.schedule import lr_at_epoch

pytestmark = [pytest.mark.oracle, pytest.mark.timeout(300)]



# ---- 1. ResNets: largebatch's against torchvision's ------------------------------------------------------------

PARAMETERS = {"resnet18": 11_689_512, "resnet50": 25_557_032}   # torchvision's, 1000 classes


def _torchvision_name(name: str) -> str:
    """largebatch's state-dict key -> torchvision's: the stem's conv and BN, and a block's projection shortcut."""
    if name.startswith("stem.0."):
        return "conv1." + name[len("stem.0."):]
    if name.startswith("stem.1."):
        return "bn1." + name[len("stem.1."):]
    return name.replace(".shortcut.", ".downsample.")


def _randomise_(net: nn.Module, seed: int) -> None:
    """Every tensor of the state dict random (BN variances positive), so that no zero gamma hides a branch."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in net.state_dict().items():
            if not t.is_floating_point():
                continue
            if key.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * (0.5 if t.ndim <= 1 else (2.0 / t[0].numel()) ** 0.5))


@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
def test_resnet_is_torchvisions_tensor_for_tensor_and_bit_for_bit(arch, one_thread):
    require_library("torchvision")
    import torchvision

    torch.manual_seed(0)
    ours = build_model(arch, 1000, width=64, stem="imagenet")          # zero_init_residual=True by default
    theirs = torchvision.models.get_model(arch, weights=None, num_classes=1000, zero_init_residual=True)
    # parameter count
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == PARAMETERS[arch]
    # a mapping of every tensor, one to one, shape for shape
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    mapping = {k: _torchvision_name(k) for k in ours_sd}
    assert sorted(mapping.values()) == sorted(theirs_sd) and len(set(mapping.values())) == len(mapping)
    for k, tk in mapping.items():
        assert ours_sd[k].shape == theirs_sd[tk].shape and ours_sd[k].dtype == theirs_sd[tk].dtype, k
    # the initialisation, tensor by tensor: BN gammas, betas and statistics equal exactly (the zero-init of each
    # block's last gamma, bn2 or bn3, included); convs He normal, fan_out, as torchvision's. The classifier is the
    # one documented difference: largebatch's N(0, 0.01) weight and zero bias (Goyal et al.), torch's default there.
    for k, tk in mapping.items():
        a, b = ours_sd[k], theirs_sd[tk]
        if k.startswith("fc."):
            continue
        if a.ndim == 4:
            expected = (2.0 / (a.shape[0] * a.shape[2] * a.shape[3])) ** 0.5
            for t in (a, b):
                assert abs(float(t.std()) / expected - 1) < 0.05, (k, float(t.std()), expected)
        else:
            assert torch.equal(a, b), f"{k} ({tk}) is initialised otherwise than torchvision's"
    assert abs(float(ours.fc.weight.detach().std()) - 0.01) < 0.001 and not torch.any(ours.fc.bias)
    # the same weights (every tensor random, so every branch counts): the same outputs, bit for bit
    _randomise_(theirs, seed=1)
    ours.load_state_dict({k: theirs.state_dict()[tk] for k, tk in mapping.items()}, strict=True)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        out_eval = ours(x)
        assert torch.equal(out_eval, theirs(x))
    ours.train()
    theirs.train()
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))   # batch statistics, and the running statistics they update
    for k, tk in mapping.items():
        assert torch.equal(ours.state_dict()[k], theirs.state_dict()[tk]), k
    # largebatch's first layer (uint8 in, one multiply-add) against torchvision's ToDtype(scale) + Normalize:
    # the same up to float32 rounding of (x/255 - mean)/std.
    from torchvision.transforms import v2

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    u8 = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    ref = v2.Normalize(mean, std)(v2.ToDtype(torch.float32, scale=True)(u8))
    got = Normalize(mean, std)(u8)
    assert (got - ref).abs().max() < 1e-5
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        assert torch.allclose(ours(got), theirs(ref), rtol=1e-4, atol=1e-4 * float(out_eval.abs().max()))


# ---- 2. LARS and LAMB: largebatch's against timm's --------------------------------------------------------------

STEPS, STEPS_PER_EPOCH = 30, 10


def _schedule(peak: float, start: float) -> list[float]:
    """largebatch's schedule: linear warm-up over the first epoch from `start`, then poly (power 2) decay to 0 at
    epoch 3; the 30 steps end at epoch 2.9, so no step after the first has lr 0."""
    return [lr_at_epoch(s / STEPS_PER_EPOCH, peak_lr=peak, start_lr=start, warmup_epochs=1.0,
                        epochs=STEPS / STEPS_PER_EPOCH, decay="poly", power=2.0) for s in range(STEPS)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return build_model("resnet18", 10, stem="small", width=8).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (8,), generator=g))
            for _ in range(STEPS)]


def _train(net: nn.Module, opt: torch.optim.Optimizer, lrs: list[float], skip: frozenset = frozenset()) -> None:
    """The loop of `largebatch train` in small: every group's lr set from the schedule, a forward and backward of
    the step's batch, one optimizer step (none at the steps in `skip`)."""
    for step, ((x, y), lr) in enumerate(zip(_batches(), lrs)):
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if step not in skip:
            opt.step()


def _max_rel_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp(min=1e-30))
               for k in sa if sa[k].is_floating_point())


TOL = 1e-9   # the largest relative difference of any tensor after 30 float64 steps (measured at most 6e-14)


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_is_timms_lars(nesterov, one_thread):
    require_library("timm")
    from timm.optim import Lars, param_groups_weight_decay

    cfg = OptimConfig(name="lars", momentum=0.9, weight_decay=5e-4, trust_coefficient=0.001, lars_eps=0.0,
                      nesterov=nesterov)

    def timms(net: nn.Module) -> Lars:
        # timm's own groups: no weight decay for ndim <= 1 and ".bias" (largebatch's are by shape: the same set).
        # timm adapts a group only where its weight decay is not 0 (always_adapt=False): the BN/bias group is
        # momentum SGD, as largebatch's lars_exclude group is. Set explicitly, each default that could differ:
        # eps (timm 1e-8, largebatch 0), LARC's trust-ratio clipping off, no dampening.
        return Lars(param_groups_weight_decay(net, weight_decay=cfg.weight_decay), lr=0.0, momentum=cfg.momentum,
                    dampening=0.0, nesterov=nesterov, trust_coeff=cfg.trust_coefficient, eps=cfg.lars_eps,
                    trust_clip=False, always_adapt=False)

    # Warm-up from a positive lr: largebatch's velocity holds the lr (momentum correction), timm's buffer does
    # not; equal whenever no step has lr 0.
    lrs = _schedule(peak=2.0, start=0.2)
    ours, theirs = _net(), _net()
    ours_opt, theirs_opt = build_optimizer(cfg, ours, lrs[0]), timms(theirs)
    _train(ours, ours_opt, lrs)
    _train(theirs, theirs_opt, lrs)
    assert _max_rel_diff(ours, theirs) < TOL
    assert _max_rel_diff(_net(), theirs) > 1e-3   # it trained
    # the state: largebatch's velocity is the lr times timm's momentum buffer
    named = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        v, buf = ours_opt.state[named[name]]["momentum_buffer"], theirs_opt.state[p]["momentum_buffer"]
        assert float((v - lrs[-1] * buf).abs().max()) <= TOL * float((lrs[-1] * buf).abs().max()), name
    # The documented difference, momentum state at lr 0: warm-up from lr 0 makes largebatch's first step no step
    # at all (velocity lr x 0), while timm's buffer keeps that gradient and spends it later; largebatch's run is
    # timm's without the optimizer step at lr 0.
    lrs0 = _schedule(peak=2.0, start=0.0)
    ours, theirs, kept = _net(), _net(), _net()
    _train(ours, build_optimizer(cfg, ours, lrs0[0]), lrs0)
    _train(theirs, timms(theirs), lrs0, skip=frozenset({0}))
    _train(kept, timms(kept), lrs0)
    assert _max_rel_diff(ours, theirs) < TOL and _max_rel_diff(ours, kept) > 1e-4


def test_lamb_is_timms_lamb(one_thread):
    require_library("timm")
    from timm.optim import Lamb, param_groups_weight_decay

    cfg = OptimConfig(name="lamb", weight_decay=0.01, betas=[0.9, 0.999], lamb_eps=1e-6)
    lrs = _schedule(peak=0.02, start=0.002)
    ours, theirs = _net(), _net()
    _train(ours, build_optimizer(cfg, ours, lrs[0]), lrs)
    # Set explicitly, each default of timm's that differs or could: its global gradient-norm clipping
    # (max_grad_norm=1.0) off; no trust-ratio clipping (LAMBC); adaptation only where weight decay is not 0
    # (always_adapt=False: the BN/bias group gets Adam's update, as largebatch's lars_exclude group); L2 weight
    # decay inside the update, not decoupled; no "caution"; bias correction on; grad averaging (1 - beta1).
    _train(theirs, Lamb(param_groups_weight_decay(theirs, weight_decay=cfg.weight_decay), lr=0.0,
                        bias_correction=True, betas=tuple(cfg.betas), eps=cfg.lamb_eps, grad_averaging=True,
                        max_grad_norm=None, trust_clip=False, always_adapt=False, caution=False,
                        decoupled_decay=False), lrs)
    assert _max_rel_diff(ours, theirs) < TOL
    assert _max_rel_diff(_net(), theirs) > 1e-3
    # timm's default clipping to a global gradient norm of 1 changes this run (by 0.77 of the largest weight)
    clipped = _net()
    _train(clipped, Lamb(param_groups_weight_decay(clipped, weight_decay=cfg.weight_decay), lr=0.0), lrs)
    assert _max_rel_diff(ours, clipped) > 1e-2


# ---- 3. The JPEG crop against torchvision's RandomResizedCrop + flip -----------------------------------------------

def _photo(seed: int, width: int, height: int) -> np.ndarray:
    """A photo-like RGB image: smooth colour regions, an oblique stripe pattern, a little sensor noise."""
    r = np.random.default_rng(seed)
    small = r.integers(0, 256, (18, 24, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    img += 30 * np.sin(xx / 7 + yy / 11)[..., None] + r.normal(0, 3, (height, width, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _torchvision_crop(image: torch.Tensor, box: tuple[int, int, int, int], size: int, flip: bool, monkeypatch
                      ) -> torch.Tensor:
    """torchvision's RandomResizedCrop(size, antialias=True) + RandomHorizontalFlip of CHW `image`, the random box
    replaced by `box` (y0, x0, y1, x1) and the coin by `flip`."""
    from torchvision.transforms import v2

    crop = v2.RandomResizedCrop(size, antialias=True)
    y0, x0, y1, x1 = box
    params = {"top": y0, "left": x0, "height": y1 - y0, "width": x1 - x0}
    monkeypatch.setattr(crop, "make_params" if hasattr(crop, "make_params") else "_get_params", lambda _: params)
    return v2.RandomHorizontalFlip(p=1.0 if flip else 0.0)(crop(image))


# Against torchvision's decode of the whole image at full scale: the mean absolute error and the largest error in
# levels of 0-255 of one crop (measured at most 1.83 and 11, at DCT factor 8, over 1,800 crops of three such
# images at sizes 64 and 160; a box 2 pixels off gives a mean of 8.7 or more, a wrong flip 52 or more).
FULL_SCALE_TOLERANCE = (2.5, 16)


@pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision are deprecated")
def test_jpeg_crop_is_torchvisions_random_resized_crop_and_flip(monkeypatch, one_thread):
    """largebatch's JPEG crop (plan_crop's box, flip and DCT factor; decode_crop's decode, resize and flip) is
    torchvision's RandomResizedCrop + RandomHorizontalFlip at the same box:
    a. on the same decoded image (largebatch's, at the plan's DCT scale), bit for bit (at most 1 level allowed;
       measured 0: both run torch's antialiased uint8 bilinear kernel);
    b. against torchvision's own decode at full scale, at that box in full-scale pixels, within
       FULL_SCALE_TOLERANCE (the fast IDCT, the chroma upsampling and the IDCT's 1/k scaling differ). The box is the
       plan's at full scale; a decode at 1/k scale crops it rounded to whole decoded pixels, within k - 1 pixels.
    Sizes 160 and 64 on a 768 x 576 JPEG give every DCT factor (1, 2, 4, 8), each with and without the flip."""
    require_library("torchvision")
    from torchvision.io import ImageReadMode, decode_jpeg

    buf = io.BytesIO()
    Image.fromarray(_photo(5, 768, 576)).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    full = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)   # CHW
    h, w = full.shape[1:]
    seen: set[tuple[int, bool]] = set()
    for size in (160, 64):
        for index in range(300):
            plan = jpeg.plan_crop(data, size, train=True, min_scale=0.08, seed=0, epoch=0, index=index)
            if (plan.k, plan.flip) in seen:
                continue
            seen.add((plan.k, plan.flip))
            where = f"size {size}, image {index}: DCT factor {plan.k}, flip {plan.flip}"
            out = torch.empty((size, size, 3), dtype=torch.uint8)
            jpeg.decode_crop(data, size, train=True, min_scale=0.08, seed=0, epoch=0, index=index, out=out)
            ours = out.permute(2, 0, 1).float()
            # a. the same decoded image, the same box in its pixels
            decoded = torch.from_numpy(jpeg._decode(data, plan.h, plan.w, plan.colorspace, plan.k)).permute(2, 0, 1)
            box = jpeg.crop_window(plan, decoded.shape[1], decoded.shape[2])
            same = _torchvision_crop(decoded, box, size, plan.flip, monkeypatch)
            assert float((ours - same.float()).abs().max()) <= 1, where
            # the box cropped is the plan's (whole pixels, as torchvision's RandomResizedCrop draws them): exactly at
            # full scale, within k - 1 pixels at 1/k
            assert decoded.shape[1] * plan.k == h and decoded.shape[2] * plan.k == w
            top, left, height, width = (int(v) for v in plan.box)
            assert plan.box == (top, left, height, width)
            box_full = tuple(v * plan.k for v in box)
            assert all(abs(a - b) < plan.k for a, b in zip(box_full, (top, left, top + height, left + width))), \
                f"{where}: box {box_full} for the plan's {(top, left, top + height, left + width)}"
            # b. torchvision's full-scale decode, the same box in full-scale pixels
            err = (ours - _torchvision_crop(full, box_full, size, plan.flip, monkeypatch).float()).abs()
            assert float(err.mean()) <= FULL_SCALE_TOLERANCE[0] and float(err.max()) <= FULL_SCALE_TOLERANCE[1], \
                f"{where}: mean {float(err.mean()):.2f}, max {float(err.max()):.0f}"
    assert seen == {(k, f) for k in (1, 2, 4, 8) for f in (False, True)}, seen
