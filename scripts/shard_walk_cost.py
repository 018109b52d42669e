"""The cost of the shards' start-up check (docs/reliability.md, "Damaged data"): before build 5
`shard_check.check_split` (then in shards.py) walked every shard's tar headers and read each label before the first
step, on every rank; since, it checks each shard's fingerprint (size, first 4 KiB, last 16 KiB: O(shards)) and
walks only a shard that fails it.

    python scripts/shard_walk_cost.py [--samples 50000] [--shards 10] [--image-kb 8] [--repeats 3]
                                      [--scale-shards 1024] [--scale-samples 1281167] [--scale-image-bytes 400]

1. A shard set written by `data pack`'s own writer (`pack._write_shards`) into a scratch directory: one
   generated JPEG of about --image-kb KB stored under every key (the walk reads headers, not images, so with the
   page cache warm the image size moves the cost little), labels spread over 1,000 classes.
2. The walk of the train split, --repeats times with the page cache warm: seconds, samples/s, and what that
   rate makes of ImageNet's 1,281,167 training samples; first the direct header walk (`check_split` on an
   index without fingerprints, as before build 5, these shards being in the plain layout), then the tarfile walk
   that shards in any other layout (pax headers of more than times, GNU extensions) take; last, where webdataset
   is installed, the walk of `data.dataset: webdataset` over the same samples written by webdataset's ShardWriter
   (.jpg, .cls and .json per sample, each after a pax header), and its fingerprint check after
   `largebatch data index` (per shard, and that per-shard cost times --scale-shards).
3. The start-up check at ImageNet's scale: --scale-samples samples in --scale-shards shards written by the same
   writer (a --scale-image-bytes payload per sample: the check reads a shard's ends and its size, never its
   images, so only the count of shards and samples matters; about 2 KiB per sample on disk), then
   `check_split` with the fingerprints, --repeats times (the per-rank start-up check), and the walk of the same
   shards once (the same set's cost before build 5).
4. The machine (`metrics.machine`) and the load average first, so the figure is read against what ran beside it.
"""
from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

IMAGENET_TRAIN = 1_281_167


def jpeg(kb: int) -> bytes:
    """A noise JPEG of about `kb` KB (noise compresses poorly, so the side sets the size)."""
    side = 16
    while True:
        buf = io.BytesIO()
        pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        if buf.tell() >= kb * 1024 or side >= 2048:
            return buf.getvalue()
        side = int(side * 1.25) + 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--shards", type=int, default=10)
    p.add_argument("--image-kb", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scale-shards", type=int, default=1024)
    p.add_argument("--scale-samples", type=int, default=IMAGENET_TRAIN)
    p.add_argument("--scale-image-bytes", type=int, default=400)
    args = p.parse_args()

    import torch

    from largebatch.data import pack, shard_check
    from largebatch.metrics import machine

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{machine(torch.device('cpu'))}; load {load}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        image = root / "image.jpg"
        image.write_bytes(jpeg(args.image_kb))
        paths = [image] * args.samples
        labels = [i % 1000 for i in range(args.samples)]
        per_shard = image.stat().st_size + 1536
        out = root / "shards"
        out.mkdir()
        index = pack._write_shards(out, [f"c{i}" for i in range(1000)], [("train", paths, labels), ("val", [], [])],
                                   per_shard * -(-args.samples // args.shards), seed=0)
        entry = index["splits"]["train"]
        mb = sum((out / s["name"]).stat().st_size for s in entry["shards"]) / 2**20
        print(f"shards: {entry['total']} samples in {len(entry['shards'])} shards, {mb:.0f} MB, "
              f"image {image.stat().st_size} bytes")
        def tarfile_walk() -> None:   # the walk of a shard in any other layout (pax, GNU extensions)
            owner = np.full(entry["total"], -1, dtype=np.int32)
            for i, shard in enumerate(entry["shards"]):
                shard_check._tar_walk(owner, i, out, "train", entry, out / shard["name"], 1000)

        unmarked = {**entry, "shards": [{"name": s["name"], "count": s["count"]} for s in entry["shards"]]}
        walks = [("header walk (check_split before build 5)",
                  lambda: shard_check.check_split(out, "train", unmarked, 1000)),
                 ("tarfile walk", tarfile_walk)]
        try:
            import webdataset
        except ImportError:
            print("webdataset is not installed (pip install -e '.[test]'): its shards are not timed")
        else:
            from largebatch.data import wds

            published = root / "published"
            published.mkdir()
            with webdataset.ShardWriter(str(published / "train-%06d.tar"), maxcount=-(-args.samples // args.shards),
                                        verbose=0) as sink:
                for i, label in enumerate(labels):
                    sink.write({"__key__": f"n{label:08d}_{i}", "jpg": image.read_bytes(), "cls": str(label).encode(),
                                "json": b'{"label": %d}' % label})
            walks.append(("webdataset walk", lambda: [wds.walk(p, 1000) for p in sorted(published.glob("*.tar"))]))
        for what, walk in walks:
            for r in range(args.repeats):
                t0 = time.perf_counter()
                walk()
                dt = time.perf_counter() - t0
                rate = entry["total"] / dt
                print(f"{what} {r + 1}: {dt:.2f} s, {rate:,.0f} samples/s; ImageNet's train split at this rate: "
                      f"{IMAGENET_TRAIN / rate:.0f} s per rank")
        if len(walks) == 3:   # webdataset's shards after `largebatch data index`: the fingerprint check
            wds.index(str(published), say=lambda line: None)
            paths = sorted(published.glob("*.tar"))
            for r in range(args.repeats):
                t0 = time.perf_counter()
                listed, sources, entries = wds.counts(paths)
                walked = wds.check_counts(paths, listed, sources, 1000, entries)
                dt = time.perf_counter() - t0
                assert not walked, walked
                print(f"webdataset fingerprint check {r + 1}: {dt * 1e3:.1f} ms for {len(paths)} shards (index read "
                      f"included), {dt / len(paths) * 1e3:.2f} ms per shard; {args.scale_shards:,} shards at this rate: "
                      f"{dt / len(paths) * args.scale_shards:.2f} s per rank")
        scale(root, args)
    return 0


def scale(root: Path, args: argparse.Namespace) -> None:
    """Step 3: the start-up check of --scale-samples samples in --scale-shards shards, and the walk it replaces."""
    from largebatch.data import pack, shard_check

    payload = root / "payload.jpg"
    payload.write_bytes(jpeg(1)[:args.scale_image_bytes])   # never decoded: the check reads no image
    out = root / "scale"
    out.mkdir()
    n, per = args.scale_samples, -(-args.scale_samples // args.scale_shards)
    t0 = time.perf_counter()
    index = pack._write_shards(out, [f"c{i}" for i in range(1000)],
                               [("train", [payload] * n, [i % 1000 for i in range(n)]), ("val", [], [])],
                               (args.scale_image_bytes + 1536) * per, seed=0)
    entry = index["splits"]["train"]
    gb = sum((out / s["name"]).stat().st_size for s in entry["shards"]) / 2**30
    print(f"scale: {entry['total']:,} samples in {len(entry['shards']):,} shards, {gb:.1f} GiB, written in "
          f"{time.perf_counter() - t0:.0f} s (page cache warm)")
    for r in range(args.repeats):
        t0 = time.perf_counter()
        walked = shard_check.check_split(out, "train", entry, 1000)
        dt = time.perf_counter() - t0
        assert not walked, walked
        print(f"start-up check (fingerprints) {r + 1}: {dt:.2f} s per rank for {len(entry['shards']):,} shards, "
              f"{entry['total']:,} samples ({dt / len(entry['shards']) * 1e3:.2f} ms per shard)")
    unmarked = {**entry, "shards": [{"name": s["name"], "count": s["count"]} for s in entry["shards"]]}
    t0 = time.perf_counter()
    walked = shard_check.check_split(out, "train", unmarked, 1000)
    dt = time.perf_counter() - t0
    assert len(walked) == len(entry["shards"])
    print(f"header walk of the same shards (before build 5): {dt:.2f} s per rank")


if __name__ == "__main__":
    raise SystemExit(main())
