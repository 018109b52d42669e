"""`largebatch bench data`: ImageFolder decode + random-resized-crop + flip, images/s.

1. Write an ImageFolder of real-size JPEGs (default 500 x 375, --width/--height, quality 90, content =
   colour gradients + smooth blobs + pixel noise, so files are about ImageNet-sized,
   ~75 KB) into --dir or a temporary directory.
2. Run largebatch's pipeline (``ImageFolderSource``: DCT-scaled simplejpeg decode,
   uint8 torch resize, batched items) over the images with N loader workers.
3. Run a plain Pillow pipeline with the same workers and batch: per-sample
   ``Image.open().convert('RGB')``, random-resized-crop with ``Image.resize(box=...)``,
   random flip, ``torch.from_numpy(np.asarray(img)).permute(2, 0, 1)``, default collate.
4. Each pipeline: one untimed warm-up pass (workers start, files enter the page
   cache), then the timed region covers exactly --passes full passes over the images
   (median pass reported). Print both rates and the speedup; --json writes them. With
   --workers 0 the work runs in this process, and images per CPU-second are reported
   too: unlike wall time they hold on a machine shared with other jobs.
"""
from __future__ import annotations

import io
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from largebatch.cli import ArgumentParser
from largebatch.errors import UserError

MACHINE = "2-core CPU container, no GPU, torch " + torch.__version__.split("+")[0]


def natural_image(seed: int, width: int = 500, height: int = 375) -> np.ndarray:
    """Step 1: an RGB uint8 image whose JPEG size resembles a photo's."""
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([(xx * r.uniform(0.2, 0.6) + yy * r.uniform(0.1, 0.5) + r.uniform(0, 255)) % 256
                     for _ in range(3)], -1)
    small = r.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    blobs = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=np.float32)
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


class PlainPillow(Dataset):
    """Step 3: the usual per-sample Pillow pipeline (torchvision's algorithm, uint8 out)."""

    def __init__(self, paths: list[str], labels: list[int], size: int, min_scale: float) -> None:
        self.paths, self.labels, self.size, self.min_scale = paths, labels, size, min_scale

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        img = Image.open(self.paths[i]).convert("RGB")
        w, h = img.size
        box = (0, 0, w, h)
        for _ in range(10):
            area = w * h * random.uniform(self.min_scale, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                top, left = random.randint(0, h - ch), random.randint(0, w - cw)
                box = (left, top, left + cw, top + ch)
                break
        img = img.resize((self.size, self.size), Image.BILINEAR, box=box)
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(img)).permute(2, 0, 1), self.labels[i]


def _time_passes(run_pass, passes: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this process per pass (step 4)."""
    run_pass()  # warm-up: workers start, page cache
    wall, cpu = [], []
    for _ in range(passes):
        start, start_cpu = time.perf_counter(), time.process_time()
        run_pass()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


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
    p.add_argument("--dir", type=Path, default=None, help="keep the generated ImageFolder here (reused if present)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.images < args.batch or args.workers < 0 or args.size < 8 or args.passes < 1:
        raise UserError("bench data needs --images >= --batch, --workers >= 0, --size >= 8 and --passes >= 1.")

    from largebatch.data.imagefolder import ImageFolderSource, scan

    with tempfile.TemporaryDirectory(prefix="largebatch-bench-data-") as tmp:
        root = args.dir or Path(tmp)
        write_imagefolder(root, args.images, width=args.width, height=args.height)
        _, paths, labels = scan(root, "train")
        paths, labels = paths[:args.images], labels[:args.images]  # a reused --dir may hold more
        nbytes = sum(Path(str(q)).stat().st_size for q in paths)
        n = len(paths)
        batches = [torch.arange(s, min(n, s + args.batch)) for s in range(0, n, args.batch)]

        ours = ImageFolderSource(paths, labels, size=args.size, min_scale=args.min_scale, seed=0, augment=True,
                                 workers=args.workers, on_corrupt="skip")
        epoch = [0]

        def ours_pass() -> None:
            epoch[0] += 1
            for x, _ in ours.batches(batches, train=True, epoch=epoch[0]):
                pass

        plain_loader = DataLoader(PlainPillow([str(q) for q in paths], labels.tolist(), args.size, args.min_scale),
                                  batch_size=args.batch, num_workers=args.workers,
                                  persistent_workers=args.workers > 0)

        def plain_pass() -> None:
            for x, _ in plain_loader:
                pass

        torch.set_num_threads(1)  # like a loader worker: one thread per decoding process
        t_ours, cpu_ours = _time_passes(ours_pass, args.passes)
        ours.close()
        t_plain, cpu_plain = _time_passes(plain_pass, args.passes)
        del plain_loader

    idx_rate = memory_rate()
    result = {
        "images": n, "width": args.width, "height": args.height, "workers": args.workers, "size": args.size,
        "batch": args.batch, "passes": args.passes,
        "mean_jpeg_kb": round(nbytes / n / 1024, 1),
        "images_per_s": round(n / t_ours, 1),
        "plain_images_per_s": round(n / t_plain, 1),
        "speedup": round(t_plain / t_ours, 2),
        "idx_images_per_s": round(idx_rate, 1) if idx_rate else None,
        "machine": MACHINE,
        **({"cpu_images_per_s": round(n / cpu_ours, 1), "plain_cpu_images_per_s": round(n / cpu_plain, 1),
            "cpu_speedup": round(cpu_plain / cpu_ours, 2)} if args.workers == 0 else {}),
        "command": "largebatch bench data " + " ".join(argv),
    }
    print(f"data pipeline, {n} JPEGs of {args.width}x{args.height} (~{result['mean_jpeg_kb']} KB), crop {args.size}, "
          f"{args.workers} workers, batch {args.batch}, median of {args.passes} passes")
    print(f"  largebatch (DCT-scaled simplejpeg + uint8 torch resize): {result['images_per_s']:>8.1f} images/s")
    print(f"  plain Pillow (open/convert, resize(box), flip, tensor):   {result['plain_images_per_s']:>8.1f} images/s")
    print(f"  speedup: {result['speedup']:.2f}x")
    if args.workers == 0:  # in-process: CPU time is meaningful even on a loaded machine
        print(f"  per CPU-second: {result['cpu_images_per_s']:.1f} vs {result['plain_cpu_images_per_s']:.1f} "
              f"images/s, {result['cpu_speedup']:.2f}x")
    if idx_rate:
        print(f"  Fashion-MNIST in memory, batched pad-crop + flip (1 thread): {idx_rate:,.0f} images/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
