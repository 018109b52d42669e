"""`largebatch bench data`: JPEG decode + random-resized-crop + flip at 224, images/s, two pipelines.

1. Write an ImageFolder of real-size JPEGs (default 500 x 375, about ImageNet's typical
   size, --width/--height, quality 90, 4:2:0; content = colour gradients + smooth blobs +
   pixel noise, so files are about ImageNet-sized, ~75 KB) into --dir or a temporary directory.
2. largebatch's pipeline (``ImageFolderSource``, what ``largebatch train`` uses): per
   batch, in a loader worker: read the file, parse the JPEG header, draw the crop box,
   decode with simplejpeg (libjpeg-turbo, fast IDCT, fast upsampling) at the smallest DCT
   scale 1/2, 1/4 or 1/8 that still gives the *crop* at least S x S pixels, resize the box
   with torch's uint8 antialiased bilinear kernel on channels-last pixels, mirror, write
   into one uint8 NHWC batch buffer. Output: uint8; the float conversion and the
   normalisation run in the model's first step (``models.Normalize``), on the accelerator.
3. The plain pipeline a user would write (torchvision's ImageNet training transform,
   re-implemented with Pillow + torch because torchvision is not installed here), per
   sample: ``default_loader`` (``Image.open(f).convert('RGB')``), ``RandomResizedCrop(S)``
   (the same box algorithm, ``img.crop(box).resize((S, S), BILINEAR)``),
   ``RandomHorizontalFlip()`` (``transpose``), ``ToTensor()`` (HWC uint8 -> CHW float32 / 255),
   ``Normalize(mean, std)`` (clone, ``sub_``, ``div_``), then the DataLoader's default
   collate (``torch.stack``; float32 batches, 4x the bytes of uint8, cross the worker queue).
4. Each pipeline: one untimed warm-up pass (workers start, files enter the page cache),
   then the timed region covers exactly --passes full passes over the images (median
   pass reported); the two pipelines' passes alternate, so a change of the machine's load
   hits both. Wall images/s, and images per CPU-second of the whole process tree (this
   process + its loader workers, from /proc): CPU time holds on a machine shared with
   other jobs, wall time does not.
5. Stage costs: both pipelines' stages timed one by one (CPU ms per image, in this
   process, on --stage-images of the files), so the docs can say where the time goes.
"""
from __future__ import annotations

import io
import json
import math
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from largebatch.commands.bench import machine
from largebatch.cli import ArgumentParser, check_numbers, check_output_path
from largebatch.data.jpeg import rrc_fallback
from largebatch.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def natural_image(seed: int, width: int = 500, height: int = 375) -> np.ndarray:
    """Step 1: an RGB uint8 image whose JPEG size resembles a photo's."""
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(xx * r.uniform(0.2, 0.6) + yy * r.uniform(0.1, 0.5) + r.uniform(0, 255)) % 256
                     for _ in range(3)], -1)
    small = r.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    blobs = np.asarray(Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
    img = 0.5 * base + 0.5 * blobs + r.normal(0, 12, (height, width, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def write_imagefolder(root: Path, images: int, classes: int = 10, width: int = 500, height: int = 375) -> None:
    """Step 1: root/train/<class>/*.jpg and a small root/val (existing files are kept)."""
    for split, count in (("train", images), ("val", max(classes, images // 10))):
        for i in range(count):
            folder = root / split / f"class{i % classes:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{split}_{i:06d}.jpg"
            if not path.exists():
                buf = io.BytesIO()
                Image.fromarray(natural_image(i + (0 if split == "train" else 10**6), width, height)).save(
                    buf, "JPEG", quality=90)
                path.write_bytes(buf.getvalue())


def _check_bench_dir(root: Path) -> None:
    """--dir takes the generated ImageFolder or one that an earlier run generated there: refuse a folder
    that holds anything else (a real dataset would get ten class folders of noise added to it)."""
    if root.exists() and not root.is_dir():
        raise UserError(f"--dir {root} is a file; give a new directory or one an earlier bench data run wrote.")
    if not root.is_dir():
        return
    for entry in root.iterdir():
        ours = entry.name in ("train", "val") and entry.is_dir() and all(
            re.fullmatch(r"class\d{3}", c.name) and c.is_dir() for c in entry.iterdir())
        if not ours:
            raise UserError(f"--dir {root} holds {entry.name}, which bench data did not write; give a new "
                            "directory (an existing dataset is never written into).")


def rrc_params(width: int, height: int, min_scale: float) -> tuple[int, int, int, int]:
    """Step 3: torchvision's ``RandomResizedCrop.get_params`` -> (top, left, height, width)."""
    area = width * height
    for _ in range(10):
        target = area * random.uniform(min_scale, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < cw <= width and 0 < ch <= height:
            return random.randint(0, height - ch), random.randint(0, width - cw), ch, cw
    return rrc_fallback(height, width)   # centre crop, ratio clamped to [3/4, 4/3]


def to_tensor(img: Image.Image) -> torch.Tensor:
    """Step 3: torchvision's ``ToTensor`` for an RGB image: CHW float32 in [0, 1]."""
    x = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(img.size[1], img.size[0], 3)
    return x.permute(2, 0, 1).contiguous().to(torch.float32).div(255)


class PlainPillow(Dataset):
    """Step 3: torchvision's ImageNet training transform with Pillow + torch, per sample, float32 out."""

    def __init__(self, paths: list[str], labels: list[int], size: int, min_scale: float) -> None:
        self.paths, self.labels, self.size, self.min_scale = paths, labels, size, min_scale
        self.mean = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with open(self.paths[i], "rb") as f:                                    # default_loader
            img = Image.open(f).convert("RGB")
        top, left, ch, cw = rrc_params(img.size[0], img.size[1], self.min_scale)  # RandomResizedCrop
        img = img.crop((left, top, left + cw, top + ch)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if random.random() < 0.5:                                               # RandomHorizontalFlip
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = to_tensor(img)                                                      # ToTensor
        x = x.clone().sub_(self.mean).div_(self.std)                            # Normalize (inplace=False)
        return x, self.labels[i]


def _tree_cpu_seconds() -> float:
    """Step 4: user + system CPU seconds of this process and its live children (Linux /proc)."""
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(entry.name) == me or int(fields[1]) == me:  # fields[1] is the parent pid
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _time_passes(run_passes: list, passes: int) -> list[tuple[float, float]]:
    """Step 4: per pipeline, median wall seconds and median process-tree CPU seconds per pass.

    The pipelines' passes alternate (A B A B ...), so a change in the machine's load
    during the run hits both alike.
    """
    for run_pass in run_passes:
        run_pass()  # warm-up: workers start, page cache
    wall: list[list[float]] = [[] for _ in run_passes]
    cpu: list[list[float]] = [[] for _ in run_passes]
    for _ in range(passes):
        for k, run_pass in enumerate(run_passes):
            start, start_cpu = time.perf_counter(), _tree_cpu_seconds()
            run_pass()
            wall[k].append(time.perf_counter() - start)
            cpu[k].append(_tree_cpu_seconds() - start_cpu)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def stage_costs(files: list[bytes], size: int, min_scale: float, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Step 5: CPU ms per image of each stage of both pipelines (best of `repeats`), in this process."""
    from largebatch.data import jpeg

    def timed(fn, inputs) -> tuple[float, list]:
        best, outs = math.inf, []
        for _ in range(repeats):
            start = time.process_time()
            outs = [fn(i, a) for i, a in enumerate(inputs)]
            best = min(best, time.process_time() - start)
        return round(1e3 * best / len(inputs), 3), outs

    mean, std = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1), torch.tensor(IMAGENET_STD).view(-1, 1, 1)
    plain: dict[str, float] = {}
    plain["open + convert('RGB')"], imgs = timed(lambda i, d: Image.open(io.BytesIO(d)).convert("RGB"), files)
    random.seed(0)
    boxes = [rrc_params(im.size[0], im.size[1], min_scale) for im in imgs]
    plain["crop + resize (bilinear)"], crops = timed(
        lambda i, im: im.crop((boxes[i][1], boxes[i][0], boxes[i][1] + boxes[i][3], boxes[i][0] + boxes[i][2]))
        .resize((size, size), Image.Resampling.BILINEAR), imgs)
    plain["flip"], _ = timed(lambda i, im: im.transpose(Image.Transpose.FLIP_LEFT_RIGHT), crops)
    plain["ToTensor"], xs = timed(lambda i, im: to_tensor(im), crops)
    plain["Normalize"], _ = timed(lambda i, x: x.clone().sub_(mean).div_(std), xs)
    plain["total"] = round(sum(plain.values()), 3)

    def header_box(i: int, d: bytes) -> tuple[tuple[int, int], jpeg.Box]:
        h, w = simplejpeg.decode_jpeg_header(d)[:2]   # one header read, as jpeg.decode_crop does
        return (h, w), jpeg.rrc_box(h, w, min_scale, 0, 0, i)

    ours: dict[str, float] = {}
    ours["header + crop box"], heads = timed(header_box, files)
    factors = [jpeg.dct_factor(h, w, box, size) for (h, w), box in heads]
    ours["decode (DCT-scaled)"], pixels = timed(
        lambda i, d: jpeg._decode(d, heads[i][0][0], heads[i][0][1], "RGB", factors[i]), files)
    out = torch.empty((size, size, 3), dtype=torch.uint8)

    def resize(i: int, px: np.ndarray) -> None:
        (h, w), (top, left, ch, cw) = heads[i]
        sy, sx = px.shape[0] / h, px.shape[1] / w
        crop = torch.from_numpy(px[int(top * sy):int(round((top + ch) * sy)), int(left * sx):int(round((left + cw) * sx))])
        crop = crop.permute(2, 0, 1).unsqueeze(0).contiguous(memory_format=torch.channels_last)
        res = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out.copy_(res[0].permute(1, 2, 0).flip(1))

    ours["crop + resize + flip (uint8)"], _ = timed(resize, pixels)
    ours["total"] = round(sum(ours.values()), 3)
    ours["decodes at reduced scale (%)"] = round(100 * sum(k > 1 for k in factors) / len(factors), 1)
    return {"plain": plain, "largebatch": ours}


def memory_rate(batch: int = 1024, steps: int = 58) -> float | None:
    """Fashion-MNIST in memory: batched pad-crop + flip, images/s (None without the data set)."""
    from largebatch.config import DataConfig
    from largebatch.data import build_data, sampler

    try:
        train, _, _ = build_data(DataConfig(), seed=0)
    except UserError:
        return None
    perm = sampler.epoch_permutation(len(train), 1, 0)
    index = [sampler.rank_batch(perm, s, batch, 0, 1) for s in range(steps)]
    for _ in train.batches(index[:2], train=True, epoch=1):
        pass
    start = time.perf_counter()
    for _ in train.batches(index, train=True, epoch=1):
        pass
    return batch * steps / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="largebatch bench data", description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=512, help="training images in the generated ImageFolder")
    p.add_argument("--workers", type=int, default=2, help="loader workers for both pipelines")
    p.add_argument("--size", type=int, default=224, help="crop size")
    p.add_argument("--batch", type=int, default=64, help="images per batch")
    p.add_argument("--passes", type=int, default=3, help="timed passes over the images (median reported)")
    p.add_argument("--width", type=int, default=500, help="width of the generated JPEGs")
    p.add_argument("--height", type=int, default=375, help="height of the generated JPEGs")
    p.add_argument("--min-scale", type=float, default=0.08, help="random-resized-crop smallest area fraction")
    p.add_argument("--stage-images", type=int, default=32, help="images for the per-stage costs (0 = skip them)")
    p.add_argument("--no-memory", action="store_true", help="skip the Fashion-MNIST in-memory rate")
    p.add_argument("--dir", type=Path, default=None, help="keep the generated ImageFolder here (reused if present)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    check_numbers(("--batch", args.batch, args.batch >= 1, "1 or more"),
                  ("--images", args.images, args.images >= args.batch, f"at least --batch ({args.batch})"),
                  ("--workers", args.workers, args.workers >= 0, "0 or more"),
                  ("--size", args.size, args.size >= 8, "8 or more pixels"),
                  ("--passes", args.passes, args.passes >= 1, "1 or more"),
                  ("--stage-images", args.stage_images, args.stage_images >= 0, "0 or more"),
                  ("--width", args.width, args.width >= 1, "1 or more pixels"),
                  ("--height", args.height, args.height >= 1, "1 or more pixels"),
                  ("--min-scale", args.min_scale, 0 < args.min_scale <= 1, "an area fraction in (0, 1]"))
    check_output_path("--json", args.json)
    if args.dir is not None:
        _check_bench_dir(args.dir)

    from largebatch.data.imagefolder import ImageFolderSource, scan

    with tempfile.TemporaryDirectory(prefix="largebatch-bench-data-") as tmp:
        root = args.dir or Path(tmp)
        write_imagefolder(root, args.images, width=args.width, height=args.height)
        _, paths, labels = scan(root, "train")
        paths, labels = paths[:args.images], labels[:args.images]  # a reused --dir may hold more
        nbytes = sum(Path(str(q)).stat().st_size for q in paths)
        n = len(paths)
        batches = [torch.arange(s, min(n, s + args.batch)) for s in range(0, n, args.batch)]

        torch.set_num_threads(1)  # like a loader worker: one thread per decoding process
        stages = stage_costs([Path(str(q)).read_bytes() for q in paths[:args.stage_images]], args.size,
                             args.min_scale) if args.stage_images else None

        # Step 2: largebatch's pipeline.
        ours = ImageFolderSource(paths, labels, size=args.size, min_scale=args.min_scale, seed=0, augment=True,
                                 workers=args.workers, on_corrupt="skip")
        epoch = [0]

        def ours_pass() -> None:
            epoch[0] += 1
            for x, _ in ours.batches(batches, train=True, epoch=epoch[0]):
                pass

        # Step 3: the plain per-sample pipeline.
        plain_loader = DataLoader(PlainPillow([str(q) for q in paths], labels.tolist(), args.size, args.min_scale),
                                  batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                  persistent_workers=args.workers > 0)

        def plain_pass(loader=plain_loader) -> None:
            for x, _ in loader:
                pass

        # Step 4: alternating timed passes.
        (t_ours, cpu_ours), (t_plain, cpu_plain) = _time_passes([ours_pass, plain_pass], args.passes)
        ours.close()
        del plain_loader

    idx_rate = None if args.no_memory else memory_rate()
    result = {
        "images": n, "width": args.width, "height": args.height, "workers": args.workers, "size": args.size,
        "batch": args.batch, "passes": args.passes,
        "mean_jpeg_kb": round(nbytes / n / 1024, 1),
        "images_per_s": round(n / t_ours, 1),
        "plain_images_per_s": round(n / t_plain, 1),
        "speedup": round(t_plain / t_ours, 2),
        "cpu_images_per_s": round(n / max(cpu_ours, 1e-9), 1),
        "plain_cpu_images_per_s": round(n / max(cpu_plain, 1e-9), 1),
        "cpu_speedup": round(cpu_plain / max(cpu_ours, 1e-9), 2),
        "stage_ms_per_image": stages,
        "idx_images_per_s": round(idx_rate, 1) if idx_rate else None,
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "machine": machine(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "command": "largebatch bench data " + " ".join(argv),
    }
    print(f"data pipeline, {n} JPEGs of {args.width}x{args.height} (~{result['mean_jpeg_kb']} KB), crop {args.size}, "
          f"{args.workers} workers, batch {args.batch}, median of {args.passes} passes")
    print(f"  {'':58s} {'img/s wall':>10s} {'img/CPU-s':>10s}")
    print(f"  {'largebatch (DCT-scaled simplejpeg, uint8 torch resize)':58s} {result['images_per_s']:>10.1f} "
          f"{result['cpu_images_per_s']:>10.1f}")
    print(f"  {'plain (Pillow RRC + flip + ToTensor + Normalize, collate)':58s} {result['plain_images_per_s']:>10.1f} "
          f"{result['plain_cpu_images_per_s']:>10.1f}")
    print(f"  speedup: {result['speedup']:.2f}x wall, {result['cpu_speedup']:.2f}x per CPU-second "
          f"(load average {result['load_average'][0]})")
    if stages:
        print(f"  CPU ms per image by stage ({args.stage_images} images, this process):")
        for side, costs in stages.items():
            print(f"    {side}: " + ", ".join(f"{k} {v}" for k, v in costs.items()))
    if idx_rate:
        print(f"  Fashion-MNIST in memory, batched pad-crop + flip (1 thread): {idx_rate:,.0f} images/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
