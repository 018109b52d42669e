"""WebDataset shards as published (largebatch/data/wds.py), tested with the real `webdataset` library: shards
written by webdataset.ShardWriter (real JPEG and PNG files from Pillow) train through largebatch exactly once
across 2 ranks x 2 loader workers, `largebatch data index` writes their counts, and shards from
`largebatch data pack` read through webdataset.WebDataset give the same images and labels."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from largebatch.config import DataConfig
from largebatch.data import build_data
from largebatch.data.sampler import eval_shard, steps_per_epoch
from largebatch.data.wds import expand_braces
from largebatch.errors import UserError

wds = pytest.importorskip("webdataset", reason="webdataset is in the test extra: pip install -e '.[test]'")

pytestmark = pytest.mark.timeout(300)
CLASSES = 4
TRAIN, VAL = 40, 12


def _image(i: int, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(i)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20, 26, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _write(root: Path, split: str, n: int, maxcount: int, json_labels: bool) -> list[int]:
    """Shards of `split` written by webdataset.ShardWriter; the labels in written order."""
    root.mkdir(parents=True, exist_ok=True)
    labels = []
    with wds.ShardWriter(str(root / f"{split}-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for i in range(n):
            label = (i * 7 + len(split)) % CLASSES
            sample = {"__key__": f"n{label:04d}_{split}{i:05d}"}
            sample["png" if i % 9 == 4 else "jpg"] = _image(i + (1000 if split == "val" else 0),
                                                            "PNG" if i % 9 == 4 else "JPEG")
            if json_labels:   # the Hugging Face ImageNet-1k layout: a .json with a label field
                sample["json"] = json.dumps({"label": label, "filename": f"{i}.JPEG"}).encode()
            else:
                sample["cls"] = label
            sink.write(sample)
            labels.append(label)
    return labels


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, list[int], list[int]]:
    """train: 40 samples in shards of 7 (uneven: 7 x 5 + 5), .cls labels; val: 12 in shards of 5, .json labels."""
    root = tmp_path_factory.mktemp("wds") / "shards"
    train = _write(root, "train", TRAIN, 7, json_labels=False)
    val = _write(root, "val", VAL, 5, json_labels=True)
    return root, train, val


def _cfg(root, **kw) -> DataConfig:
    return DataConfig(dataset="webdataset", root=str(root), image_size=16, min_scale=0.3,
                      **{"loader_workers": 2, "num_classes": CLASSES, **kw})


def _digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.glob("*.tar"))}


def _indexed(published, tmp_path: Path, cli) -> Path:
    import shutil

    root = tmp_path / "shards"
    shutil.copytree(published[0], root)
    (root / "index.json").unlink(missing_ok=True)
    before = _digest(root)
    proc = cli("data", "index", root, check=True)
    assert "9 shards, 52 samples" in proc.stdout and "labels seen: 0..3" in proc.stdout, proc.stdout
    assert _digest(root) == before   # the shards are only read
    return root


def test_brace_expansion_as_braceexpand_does_it():
    import braceexpand

    for pattern in ("a-{000..012}.tar", "x{1,2}{a,b}", "s-{8..11}.tar", "{a,b{1..3}}c", "plain.tar"):
        assert expand_braces(pattern) == list(braceexpand.braceexpand(pattern)), pattern


def test_data_index_writes_the_counts_beside_the_shards_atomically(published, tmp_path, cli):
    with pytest.raises(UserError, match="count once with 'largebatch data index"):
        build_data(_cfg(published[0]), seed=0)
    root = _indexed(published, tmp_path, cli)
    index = json.loads((root / "index.json").read_text())
    assert index["__kind__"] == "wids-shard-index-v1"
    counts = {e["url"]: e["nsamples"] for e in index["shardlist"]}
    assert counts == {**{f"train-{i:06d}.tar": 7 for i in range(5)}, "train-000005.tar": 5,
                      "val-000000.tar": 5, "val-000001.tar": 5, "val-000002.tar": 2}
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []   # no temporary file left
    # Indexing a pattern of some shards keeps the other entries.
    proc = cli("data", "index", f"{root}/val-{{000000..000002}}.tar", check=True)
    assert "3 shards, 12 samples" in proc.stdout
    assert json.loads((root / "index.json").read_text())["shardlist"] == index["shardlist"]


def test_webdataset_shards_train_exactly_once_on_2_ranks_x_2_workers(published, tmp_path, cli, monkeypatch):
    root = _indexed(published, tmp_path, cli)
    _, train_labels, val_labels = published
    monkeypatch.setenv("WORLD_SIZE", "2")
    sources = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        train, test, info = build_data(_cfg(root), seed=3)
        sources.append((train, test))
    assert (info.num_classes, info.train_size, info.test_size) == (CLASSES, TRAIN, VAL)
    # Evaluation: the 12 val samples exactly once, with the labels of their .json members.
    seen = {}
    for rank, (_, test) in enumerate(sources):
        idx = eval_shard(VAL, rank, 2)
        ys = [y for _, y in test.batches(list(idx.split(4)), train=False, epoch=0)]
        for k, y in zip(torch.cat(test.last_keys).tolist(), torch.cat(ys).tolist()):
            assert k not in seen
            seen[k] = y
    assert seen == dict(enumerate(val_labels))
    # Training: 40 samples, global batch 8: 5 steps of 4 per rank use every sample exactly once per epoch.
    steps = steps_per_epoch(TRAIN, 8)
    orders = []
    for epoch in (0, 1):
        got = {}
        for train, _ in sources:
            out = list(train.batches([torch.zeros(4)] * steps, train=True, epoch=epoch))
            assert [tuple(x.shape) for x, _ in out] == [(4, 3, 16, 16)] * steps
            keys = torch.cat(train.last_keys).tolist()
            for k, y in zip(keys, torch.cat([y for _, y in out]).tolist()):
                assert k not in got
                got[k] = y
            orders.append(keys)
        assert got == dict(enumerate(train_labels)), epoch
    assert orders[:2] != orders[2:]   # a new order every epoch


def test_brace_patterns_and_val_root(published, tmp_path, cli):
    root = _indexed(published, tmp_path, cli)
    train, test, info = build_data(_cfg(f"{root}/train-{{000000..000005}}.tar",
                                        val_root=f"{root}/val-{{000000..000001}}.tar"), seed=0)
    assert (len(train), len(test)) == (TRAIN, 10)
    with pytest.raises(UserError, match="set data.val_root"):
        build_data(_cfg(f"{root}/train-{{000000..000005}}.tar"), seed=0)
    with pytest.raises(UserError, match=r"matches no file \(3 names, none exists\)"):
        build_data(_cfg(f"{root}/tain-{{000000..000002}}.tar"), seed=0)
    with pytest.raises(UserError, match=r"shard .*train-000006.tar does not exist \(4 of 10 are missing\)"):
        build_data(_cfg(f"{root}/train-{{000000..000009}}.tar", val_root=str(root)), seed=0)


def _rewrite_member(path: Path, name: str, data: bytes | None) -> None:
    """Shard `path` with member `name` replaced by `data` (None: left out)."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for m, old in members:
            if m.name == name and data is None:
                continue
            body = data if m.name == name else old
            info = tarfile.TarInfo(m.name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))


def _first(root: Path, shard: str, ext: str) -> str:
    with tarfile.open(root / shard) as tar:
        return next(m.name for m in tar.getmembers() if m.name.endswith("." + ext))


@pytest.mark.parametrize("damage, fragment", [
    ("no label", "has no label"),
    ("not an integer", "holds b'three', not a class number"),
    ("out of range", "holds class 9, outside 0..3 (data.num_classes is 4)"),
    ("no json label", "no JSON object with a label or cls field"),
])
def test_bad_labels_are_one_sentence_exit_2_and_nothing_written(published, tmp_path, cli, damage, fragment):
    root = _indexed(published, tmp_path, cli)
    if damage == "no json label":
        shard, name = "val-000001.tar", _first(root, "val-000001.tar", "json")
        _rewrite_member(root / shard, name, b'{"filename": "x.JPEG"}')
    else:
        shard, name = "train-000002.tar", _first(root, "train-000002.tar", "cls")
        _rewrite_member(root / shard, name, {"no label": None, "not an integer": b"three",
                                             "out of range": b"9"}[damage])
    proc = cli("train", "--set", "data.dataset=webdataset", "--set", f"data.root={root}",
               "--set", f"data.num_classes={CLASSES}", "--set", "data.image_size=16", "--set", "model.width=4",
               "--run-dir", tmp_path / "run", "--quiet")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0] and shard in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("size", [-512, -(2**80)])
def test_a_member_with_a_negative_size_is_one_sentence_not_a_hang(published, tmp_path, size):
    """A size field in tar's base-256 form that reads as negative: tarfile then reads the same header again
    without end (-512) or fails to seek (ValueError): each is one sentence naming the shard and the member."""
    from largebatch.data import wds as W

    shard = tmp_path / "train-000000.tar"
    data = bytearray((published[0] / shard.name).read_bytes())
    with tarfile.open(published[0] / shard.name) as tar:
        first = next(iter(tar))
    at = first.offset_data - 512   # the member's own header (after webdataset's pax header)
    data[at + 124:at + 136] = b"\xff" + (256**11 + size).to_bytes(11, "big")
    data[at + 148:at + 156] = b" " * 8
    data[at + 148:at + 156] = b"%06o\0 " % sum(data[at:at + 512])
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match=f"shard {shard} has a member {first.name} with a negative size \\({size}\\); "
                                        "copy the shard again"):
        W.walk(shard, CLASSES)


_OPENS: list[tuple[str, str | None]] = []   # (file, mode) opened while a test listens: sys.audit's "open" events
_HOOKED: list[bool] = []                      # an audit hook stays for the process: install it once


def _count_opens(event: str, args: tuple) -> None:
    if event == "open" and _OPENS and isinstance(args[0], (str, Path)):
        _OPENS.append((str(args[0]), args[1]))


def test_the_start_up_walk_opens_a_shard_once_for_its_headers_and_once_for_large_labels(tmp_path):
    """Labels longer than the bytes read with their header (a .json of 1 KB here) are read with pread on one
    descriptor held for the shard's walk, not by opening the shard again for each sample. Both opens are
    os.open's (mode None): the direct walk's, not tarfile's (which opens the shard in mode 'rb')."""
    import sys

    from largebatch.data import wds as W

    shard = tmp_path / "train-000000.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i in range(6):
            sink.write({"__key__": f"s{i}", "jpg": _image(i),
                        "json": json.dumps({"label": i % CLASSES, "caption": "x" * 1000}).encode()})
    if not _HOOKED:
        sys.addaudithook(_count_opens)
        _HOOKED.append(True)
    _OPENS[:] = [("listening", None)]
    try:
        assert W.walk(shard, CLASSES) == (6, CLASSES - 1)
        opened = [mode for name, mode in _OPENS[1:] if name == str(shard)]
    finally:
        _OPENS.clear()
    assert opened == [None, None], opened   # plain_members' header walk, then the reader's one descriptor


@pytest.mark.parametrize("kind, fragment", [("directory", "(Is a directory)"), ("fifo", "is empty (0 bytes)")])
def test_a_directory_or_fifo_named_like_a_shard_is_one_sentence_not_a_traceback_or_a_hang(tmp_path, kind, fragment):
    """A directory's *.tar files are its shards: a directory or a FIFO among them is named, at once."""
    import os

    from largebatch.data import wds as W

    path = tmp_path / "train-000000.tar"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(UserError, match=f"shard {path} .*" + fragment.replace("(", "\\(").replace(")", "\\)")):
        W.walk(path, CLASSES)


def test_a_brace_pattern_matching_nothing_exits_2_and_writes_nothing(tmp_path, cli):
    proc = cli("train", "--set", "data.dataset=webdataset", "--set", f"data.root={tmp_path}/x-{{0..3}}.tar",
               "--run-dir", tmp_path / "run", "--quiet")
    assert proc.returncode == 2 and "matches no file (4 names, none exists)" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("on_corrupt", ["skip", "fail"])
def test_an_image_that_cannot_be_read_follows_on_corrupt(published, tmp_path, cli, on_corrupt):
    root = _indexed(published, tmp_path, cli)
    name = _first(root, "val-000000.tar", "jpg")
    _rewrite_member(root / "val-000000.tar", name, b"not an image at all")
    _, test, _ = build_data(_cfg(root, on_corrupt=on_corrupt, loader_workers=0), seed=0)
    batches = [torch.arange(VAL)]
    if on_corrupt == "fail":
        with pytest.raises(UserError, match=f"corrupt image val-000000.tar/{name} in the shards"):
            list(test.batches(batches, train=False, epoch=0))
        return
    got = sum(len(y) for _, y in test.batches(batches, train=False, epoch=0))
    assert got == VAL - 1 and test.corrupt == [f"val-000000.tar/{name}"]


def test_shards_from_data_pack_read_through_webdataset_give_the_same_images_and_labels(tmp_path, cli):
    rng = np.random.default_rng(5)
    sources = {}
    for split, count in (("train", 9), ("val", 5)):
        for i in range(count):
            folder = tmp_path / "if" / split / f"c{i % 3}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (18, 22, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=85)
            if split == "train":
                data = (folder / f"{i}.jpg").read_bytes()
                sources[hashlib.sha256(data).hexdigest()] = (folder / f"{i}.jpg", i % 3)
    cli("data", "pack", tmp_path / "if", tmp_path / "sh", "--shard-size-mb", "0.002", check=True)
    index = json.loads((tmp_path / "sh" / "index.json").read_text())
    urls = [str(tmp_path / "sh" / s["name"]) for s in index["splits"]["train"]["shards"]]
    assert len(urls) >= 2
    raw = list(wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__", "jpg", "cls"))
    decoded = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb8").to_tuple("jpg", "cls"))
    assert len(raw) == len(decoded) == 9
    for (key, data, cls), (image, label) in zip(raw, decoded):
        path, want = sources[hashlib.sha256(data).hexdigest()]   # the image's bytes, copied whole by pack
        assert int(cls) == label == want
        assert np.array_equal(image, np.asarray(Image.open(path).convert("RGB")))
    assert [int(k) for k, _, _ in raw] == sorted(int(k) for k, _, _ in raw)   # keys are positions, in order
    # largebatch reads the same shard set (data.dataset shards) with the same labels by key.
    _, test, _ = build_data(DataConfig(dataset="shards", root=str(tmp_path / "sh"), image_size=16,
                                       loader_workers=0), seed=0)
    assert len(test) == 5


def test_a_factory_model_trains_resumes_and_evaluates_on_webdataset_shards(published, tmp_path, cli):
    from test_any_model import FACTORY_PATH, _train_resume_evaluate

    root = _indexed(published, tmp_path, cli)
    result = _train_resume_evaluate(
        cli, tmp_path, "test_any_model:make_model",
        ["--set", "data.dataset=webdataset", "--set", f"data.root={root}", "--set", f"data.num_classes={CLASSES}",
         "--set", "data.image_size=16", "--set", "data.loader_workers=0"], env={"PYTHONPATH": FACTORY_PATH})
    assert result["model"]["source"].startswith("test_any_model (")


def test_indexed_shards_are_not_walked_at_start_up_unless_changed_or_without_fingerprints(published, tmp_path, cli,
                                                                                          monkeypatch):
    """`largebatch data index` records each shard's fingerprint (size, largest label, a digest of its ends): start-up
    takes a matching shard as indexed (no walk), walks one changed since, and walks every shard of a wids list
    without fingerprints (one as published), as before."""
    from largebatch.data import wds as W

    root = _indexed(published, tmp_path, cli)
    index = json.loads((root / "index.json").read_text())
    assert all({"size", "max_label", "ends"} <= set(e) for e in index["shardlist"]), index["shardlist"][0]
    walked: list[str] = []
    walk = W.walk

    def counted(path, num_classes):
        walked.append(path.name)
        return walk(path, num_classes)

    monkeypatch.setattr(W, "walk", counted)
    build_data(_cfg(root), seed=0)
    assert walked == []
    with pytest.raises(UserError, match="holds class 3, outside 0..2 \\(data.num_classes is 3\\)"):
        build_data(_cfg(root, num_classes=3), seed=0)   # a recorded label outside the classes: walked, named
    walked.clear()
    _rewrite_member(root / "train-000003.tar", _first(root, "train-000003.tar", "cls"), b"1")
    build_data(_cfg(root), seed=0)
    assert walked == ["train-000003.tar"]
    walked.clear()
    for entry in index["shardlist"]:
        for key in ("size", "max_label", "ends"):
            entry.pop(key)
    (root / "index.json").write_text(json.dumps(index))
    build_data(_cfg(root), seed=0)
    assert sorted(walked) == sorted(p.name for p in root.glob("*.tar"))
