"""Tar shards: pack an ImageFolder, read exactly once across 2 ranks x 2 loader workers."""
from __future__ import annotations

import io
import json
import os
import random
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from largebatch.config import DataConfig
from largebatch.data import build_data
from largebatch.data.sampler import epoch_permutation, eval_shard, steps_per_epoch
from largebatch.data.shards import ShardSource, slot_ranges
from largebatch.errors import UserError

pytestmark = pytest.mark.timeout(240)


def _tree(root: Path, train: int = 37, val: int = 11) -> None:
    rng = np.random.default_rng(0)
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            folder = root / split / f"c{i % 3}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (24, 30, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=80)


def test_slot_ranges_partition_uneven_shards():
    counts = [5, 1, 9, 3, 7]  # uneven, fewer shards than 3 ranks x 2 workers
    order = [2, 0, 4, 1, 3]
    seen = []
    for rank in range(3):
        per_rank = 0
        for pieces in slot_ranges(counts, order, rank, 3, 2):
            for shard, a, b in pieces:
                seen += [(shard, j) for j in range(a, b)]
                per_rank += b - a
        assert per_rank == len(eval_shard(sum(counts), rank, 3))
    assert sorted(seen) == sorted((s, j) for s, c in enumerate(counts) for j in range(c))


def test_pack_and_read_exactly_once_two_ranks_two_workers(tmp_path, cli):
    _tree(tmp_path / "if")
    proc = cli("data", "pack", tmp_path / "if", tmp_path / "sh", "--shard-size-mb", "0.004")
    assert proc.returncode == 0, proc.stderr
    index = json.loads((tmp_path / "sh" / "index.json").read_text())
    shards = index["splits"]["train"]["shards"]
    assert len(shards) >= 4 and sum(s["count"] for s in shards) == 37
    with tarfile.open(tmp_path / "sh" / shards[0]["name"]) as tar:
        names = tar.getnames()
    assert names[0].endswith(".jpg") and names[1] == names[0][:-4] + ".cls"
    # Pack order is shuffled (not class-sorted).
    labels = [int(tarfile.open(tmp_path / "sh" / s["name"]).extractfile(m).read())
              for s in shards for m in tarfile.open(tmp_path / "sh" / s["name"]) if m.name.endswith(".cls")]
    assert labels != sorted(labels) and sorted(labels) == sorted([i % 3 for i in range(37)])

    def source(split: str, rank: int) -> ShardSource:
        return ShardSource(tmp_path / "sh", index["splits"][split], num_classes=3, size=16, min_scale=0.3, seed=1,
                           augment=True, workers=2, on_corrupt="fail", rank=rank, world=2)

    # Evaluation: the whole val split exactly once across the 2 ranks, in the trainer's batch sizes.
    val_keys = []
    for rank in range(2):
        src = source("val", rank)
        idx = eval_shard(len(src), rank, 2)
        got = [(x.shape, len(y)) for x, y in src.batches(list(idx.split(4)), train=False, epoch=0)]
        assert sum(n for _, n in got) == len(idx) and all(s[1:] == (3, 16, 16) for s, _ in got)
        val_keys += torch.cat(src.last_keys).tolist()
    assert sorted(val_keys) == list(range(11))
    # Training epoch: each rank runs the same number of steps; keys disjoint, never repeated.
    gb = 8
    steps = steps_per_epoch(37, gb)
    for epoch in (0, 1):
        keys = []
        for rank in range(2):
            src = source("train", rank)
            out = list(src.batches([torch.zeros(gb // 2)] * steps, train=True, epoch=epoch))
            assert [len(y) for _, y in out] == [gb // 2] * steps
            keys += torch.cat(src.last_keys).tolist()
        assert len(keys) == steps * gb and len(set(keys)) == len(keys) and max(keys) < 37
        if epoch == 0:
            first = keys
    assert keys != first  # a new shard permutation and shuffle every epoch


def test_shards_build_data_errors(tmp_path):
    from largebatch.commands.data.pack import main as data_pack

    with pytest.raises(UserError, match="largebatch data pack"):
        build_data(DataConfig(dataset="shards", root=str(tmp_path)), seed=0)
    # In-process (the CLI turns UserError into exit 2; the pack test above runs the real CLI).
    with pytest.raises(UserError):
        data_pack([str(tmp_path / "missing"), str(tmp_path / "out")])


# ---- damaged shards: exactly once, or one sentence naming the shard -------------------------------------------

@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """An intact shard set (37 train, 11 val samples, 3 classes, several shards per split)."""
    from largebatch.data.pack import pack

    root = tmp_path_factory.mktemp("packed")
    _tree(root / "if")
    pack(root / "if", root / "sh", shard_bytes=4096)
    return root / "sh"


def _copy(packed: Path, tmp_path: Path) -> tuple[Path, dict]:
    dst = tmp_path / "sh"
    shutil.copytree(packed, dst)
    return dst, json.loads((dst / "index.json").read_text())


def _rewrite(path: Path, edit) -> None:
    """Rewrite a shard as `edit(members)` gives it: members are (TarInfo, bytes or None) pairs."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in edit(members):
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def _set_label(value: bytes):
    def edit(members):
        return [(m, value if m.name.endswith(".cls") and i == 1 else d) for i, (m, d) in enumerate(members)]
    return edit


def _first(split: str):
    return lambda index: index["splits"][split]["shards"][0]["name"]


# Each damage: what to do to a copy of the packed set, and what the one sentence must say.
DAMAGES = {
    "val shard cut in half": (
        lambda root, index: (root / _first("val")(index)).write_bytes(
            (root / _first("val")(index)).read_bytes()[: (root / _first("val")(index)).stat().st_size // 2]),
        ["val-000000.tar", "re-pack"]),
    "train shard cut at a member boundary": (
        lambda root, index: _rewrite(root / _first("train")(index), lambda ms: ms[:2]),
        ["train-000000.tar holds 1 samples but index.json lists", "truncated"]),
    "not a tar": (lambda root, index: (root / _first("train")(index)).write_bytes(b"<html>not found</html>" * 40),
                  ["train-000000.tar is not an uncompressed tar archive"]),
    "empty file": (lambda root, index: (root / _first("val")(index)).write_bytes(b""),
                   ["val-000000.tar is empty (0 bytes)"]),
    "missing shard": (lambda root, index: (root / _first("train")(index)).unlink(),
                      ["train-000000.tar listed in index.json is missing"]),
    "a directory in a shard's place": (lambda root, index: ((root / _first("train")(index)).unlink(), (
        root / _first("train")(index)).mkdir()), ["train-000000.tar is a directory", "copy the shard file there again"]),
    "a FIFO in a shard's place (no hang)": (lambda root, index: ((root / _first("val")(index)).unlink(), os.mkfifo(
        root / _first("val")(index))), ["val-000000.tar is empty (0 bytes)"]),
    "directory member": (lambda root, index: _rewrite(root / _first("train")(index),
                                                      lambda ms: [(_member("sub", tarfile.DIRTYPE), None)] + ms),
                         ["has a directory member sub"]),
    "symlink member": (lambda root, index: _rewrite(root / _first("train")(index), lambda ms: ms + [
        (_member("000000099.jpg", tarfile.SYMTYPE, "/etc/passwd"), None)]), ["has a link member 000000099.jpg"]),
    "absolute member": (lambda root, index: _rewrite(root / _first("train")(index), lambda ms: [
        (_member("/tmp/000000000.jpg"), b"x")] + ms), ["absolute name /tmp/000000000.jpg"]),
    "dot-dot member": (lambda root, index: _rewrite(root / _first("train")(index), lambda ms: [
        (_member("../000000000.jpg"), b"x")] + ms), ["goes up with '..'"]),
    "other member": (lambda root, index: _rewrite(root / _first("train")(index), lambda ms: ms + [
        (_member("notes.txt"), b"x")]), ["notes.txt that is neither <key>.jpg nor <key>.cls"]),
    "label not a number": (lambda root, index: _rewrite(root / _first("train")(index), _set_label(b"cat")),
                           ["holds b'cat', not a class number"]),
    "label outside the classes": (lambda root, index: _rewrite(root / _first("val")(index), _set_label(b"3")),
                                  ["holds class 3, outside 0..2 (index.json lists 3 classes)"]),
    "image without label": (lambda root, index: _rewrite(root / _first("train")(index),
                                                         lambda ms: [ms[0]] + ms[2:]),
                            ["has no label member"]),
    "duplicate key": (lambda root, index: _rewrite(root / _first("train")(index), lambda ms: ms + ms[:2]),
                      ["twice"]),
    "key in two shards": (lambda root, index: _rewrite(
        root / index["splits"]["train"]["shards"][1]["name"], lambda ms: ms[:-2] + _members_of(root, _first(
            "train")(index))[:2]), ["is in shard", "and in shard", "train-000000.tar"]),
    "count overstated": (lambda root, index: _edit_index(root, lambda ix: ix["splits"]["val"]["shards"][0].update(
        count=ix["splits"]["val"]["shards"][0]["count"] + 1) or ix["splits"]["val"].update(
        total=ix["splits"]["val"]["total"] + 1)), ["val-000000.tar holds", "but index.json lists"]),
    "member with a negative size": (lambda root, index: _set_size(root / _first("train")(index), 1, b"\xff" * 12),
                                    ["has a member 000000", ".cls with a negative size (-1)"]),
    "member size beyond any file": (lambda root, index: _set_size(root / _first("train")(index), 1,
                                                                   b"\xff" + b"\x80" + bytes(10)), ["negative size"]),
    "index without classes": (lambda root, index: _edit_index(root, lambda ix: ix.pop("classes")),
                              ["index.json: classes is missing or not a list"]),
    "count as a string": (lambda root, index: _edit_index(root, lambda ix: ix["splits"]["train"]["shards"][0].update(
        count="5")), ["splits.train.shards[0].count is missing or not a whole number"]),
    "shard name with a path": (lambda root, index: _edit_index(
        root, lambda ix: ix["splits"]["train"]["shards"][0].update(name="../train-000000.tar")),
        ["splits.train.shards[0].name is missing or not a file name"]),
    "index not JSON": (lambda root, index: (root / "index.json").write_bytes(b"\xff{"), ["cannot read"]),
}


def _set_size(path: Path, nth: int, field: bytes) -> None:
    """Write `field` (12 bytes: octal, or tar's base-256 with a 0o200/0o377 first byte) as the size of the
    shard's `nth` member, its checksum made valid again: damage that only the size field tells."""
    data = bytearray(path.read_bytes())
    at = _header_offsets(bytes(data))[nth]
    data[at + 124:at + 136] = field
    _fix_checksum(data, at)
    path.write_bytes(bytes(data))


def _members_of(root: Path, name: str) -> list:
    with tarfile.open(root / name) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar]


def _edit_index(root: Path, edit) -> None:
    index = json.loads((root / "index.json").read_text())
    edit(index)
    (root / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_shard_set_is_refused_at_start_up_naming_the_shard(packed, tmp_path, damage):
    root, index = _copy(packed, tmp_path)
    do, fragments = DAMAGES[damage]
    do(root, index)
    with pytest.raises(UserError) as err:
        build_data(DataConfig(dataset="shards", root=str(root), image_size=16, loader_workers=0), seed=0)
    text = str(err.value)
    for fragment in fragments:
        assert fragment in text, text
    assert "\n" not in text and ("re-pack" in text or "re-run" in text or "copy it" in text), text


def test_an_intact_shard_set_passes_the_start_up_check(packed, tmp_path):
    root, _ = _copy(packed, tmp_path)
    train, test, info = build_data(DataConfig(dataset="shards", root=str(root), image_size=16), seed=0)
    assert (len(train), len(test), info.num_classes) == (37, 11, 3)


def _tar_keys(path: Path, num_classes: int) -> list[int]:
    """check_split's tarfile walk of one shard: its keys in order, or the UserError it raises."""
    from largebatch.data.shard_check import read_label, samples_in
    from largebatch.data.tar import open_shard

    tar, size = open_shard(path)
    with tar:
        keys = []
        for key, group in samples_in(tar, str(path), size):
            read_label(tar, str(path), group["cls"], num_classes)
            keys.append(key)
    return keys


def _header_offsets(data: bytes) -> list[int]:
    offsets, off = [], 0
    while off + 512 <= len(data) and data[off:off + 512] != bytes(512):
        offsets.append(off)
        off += 512 + -(-int(data[off + 124:off + 135], 8) // 512) * 512
    return offsets


def _fix_checksum(out: bytearray, at: int) -> None:
    """The header at `at` made valid again: its checksum is the sum of its bytes with the field as spaces."""
    out[at + 148:at + 156] = b" " * 8
    out[at + 148:at + 156] = b"%06o\0 " % sum(out[at:at + 512])


def _mutate(data: bytes, rng: random.Random) -> bytes:
    """One random change to a shard's bytes: a header byte (often with its checksum made valid again, so the
    field rules are reached), a small member's bytes (a label, pax records), a pax record that renames or
    resizes written into one, a header zeroed, a member turned into a directory, a cut, a member twice, or
    blocks appended."""
    out = bytearray(data)
    heads = _header_offsets(data)
    small = [at for at in heads if int(data[at + 124:at + 135], 8) <= 64]
    kind = rng.randrange(9)
    if kind <= 1:
        at = rng.choice(heads)
        pos = rng.randrange(*rng.choice([(0, 20), (100, 157), (329, 346), (0, 512)]))   # name, fields, dev+prefix
        out[at + pos] = rng.choice(b"0179 /.x\0\x80\xff") if rng.random() < 0.8 else rng.randrange(256)
        if kind == 1 and not 148 <= pos < 156:
            _fix_checksum(out, at)
    elif kind == 2:
        at = rng.choice(small) + 512 + rng.randrange(64)
        out[at:at + 2] = bytes(rng.choice(b"0123456789 =.\n\0x") for _ in range(2))
    elif kind == 3:   # a pax record of another kind in a small member's data: over or past its records, or
        at = rng.choice(small)          # as its only record, of just the length the header gives
        n = int(data[at + 124:at + 135], 8)
        key = rng.choice([b"path", b"size", b"uid", b"mtime", b"hdrcharset"])
        if rng.random() < 0.5 and n >= 16:
            text = key + b"=" + (b"z" if key == b"path" else b"0") * (n - len(key) - 5) + b"3"
            record = b"%d %s\n" % (n, text)
        else:
            text = key + b"=" + rng.choice([b"zz", b"3", b"x", b"BINARY"])
            record = b"%d %s\n" % (len(text) + 4, text)
            at += rng.choice([0, n])
        out[at + 512:at + 512 + len(record)] = record
    elif kind == 4:
        at = rng.choice(heads)
        out[at:at + 512] = bytes(512)
    elif kind == 5:   # a directory by name (a V7 tar's way) or by type
        at = rng.choice(heads)
        end = data.find(b"\0", at, at + 100)
        out[end - 1] = ord("/")
        out[at + 156] = rng.choice(b"\x005")
        _fix_checksum(out, at)
    elif kind == 6:
        del out[rng.randrange(len(out)):]
    elif kind == 7:   # a member's record (header and data) twice in a row
        i = rng.randrange(len(heads))
        end = heads[i + 1] if i + 1 < len(heads) else heads[i] + 512 + -(-int(data[heads[i] + 124:heads[i] + 135], 8)
                                                                          // 512) * 512
        out[end:end] = data[heads[i]:end]
    else:
        at = rng.choice(heads)
        out += rng.choice([bytes(512), data[at:at + 1024], bytes(rng.randrange(256) for _ in range(700))])
    return bytes(out)


def _tar_members(path: Path) -> list[tuple] | str:
    """What tarfile reads of a shard: each member's name, data offset, size, kind and bytes, or its error."""
    try:
        with tarfile.open(path, "r:") as tar:
            return [(m.name, m.offset_data, m.size, m.isreg(), tar.extractfile(m).read() if m.isreg() else None)
                    for m in tar]
    except (tarfile.TarError, OSError) as err:
        return repr(err)


def _webdataset_shard(path: Path) -> None:
    """A shard written by webdataset's own writer: a pax header (the mtime) before every member."""
    import webdataset

    with webdataset.TarWriter(str(path)) as sink:
        for i in range(6):
            sink.write({"__key__": f"n0144_{i}", "jpg": bytes([i]) * (300 + 97 * i), "cls": b"%d" % (i % 3),
                        "json": b'{"label": %d}' % (i % 3)})


def test_the_direct_header_walk_reads_what_tarfile_reads_or_steps_aside(packed, tmp_path):
    """`plain_members` (the headers read directly: check_split's and the webdataset walk's fast path) reads
    the shards `data pack` and webdataset's writer write; on 800 random changes to each shard's bytes it either
    steps aside (Unusual: tarfile walks that shard) or reads exactly the members tarfile reads: the same names,
    offsets, sizes and bytes, every one a file. So it never accepts what tarfile refuses or reads otherwise."""
    from largebatch.data.tar import PlainReader, Unusual, plain_members

    index = json.loads((packed / "index.json").read_text())
    _webdataset_shard(tmp_path / "wds.tar")
    for original in (packed / index["splits"]["train"]["shards"][0]["name"], tmp_path / "wds.tar"):
        with PlainReader(original, "") as read:
            assert [(m.name, m.offset_data, m.size, True, read(m))
                    for m in plain_members(original)] == _tar_members(original)
        rng, victim, data = random.Random(0), tmp_path / "shard.tar", original.read_bytes()
        fast = stepped_aside = 0
        for _ in range(800):
            victim.write_bytes(_mutate(data, rng))
            slow = _tar_members(victim)
            try:
                got = plain_members(victim)
            except Unusual:
                stepped_aside += 1
                continue
            fast += 1
            with PlainReader(victim, "") as read:
                assert [(m.name, m.offset_data, m.size, True, read(m)) for m in got] == slow
        # both outcomes are reached often: the fields it ignores (uname, mtime's digits, ...) stay on the fast path
        assert fast >= 100 and stepped_aside >= 150, (original.name, fast, stepped_aside)


def test_the_direct_walk_of_packed_shards_applies_the_tarfile_walks_rules(packed, tmp_path):
    """check_split's fast path (`_plain_keys`) on 800 random changes to a packed shard: it steps aside or gives
    exactly the keys of the tarfile walk (`samples_in` and `read_label`), never keys where that walk refuses."""
    from largebatch.data.shard_check import _plain_keys
    from largebatch.data.tar import Unusual

    index = json.loads((packed / "index.json").read_text())
    for split in ("train", "val"):
        for shard in index["splits"][split]["shards"]:
            assert _plain_keys(packed / shard["name"], 3) == _tar_keys(packed / shard["name"], 3)
    original = (packed / index["splits"]["train"]["shards"][0]["name"]).read_bytes()
    rng, victim = random.Random(1), tmp_path / "shard.tar"
    fast = 0
    for _ in range(800):
        victim.write_bytes(_mutate(original, rng))
        try:
            slow: list[int] | str = _tar_keys(victim, 3)
        except UserError as err:
            slow = str(err)
        try:
            got = _plain_keys(victim, 3)
        except Unusual:
            continue
        fast += 1
        assert got == slow, (victim.read_bytes(), got, slow)
    assert fast >= 60, fast


def test_the_direct_header_walk_decodes_names_as_tarfile_does_under_any_filesystem_encoding(tmp_path):
    """Under the C locale (an ASCII file-system encoding) tarfile decodes a non-ASCII member name with surrogate
    escapes: the direct walk reads the same names, so the two walks never disagree about a member."""
    import subprocess
    import sys

    with tarfile.open(tmp_path / "shard.tar", "w", format=tarfile.USTAR_FORMAT, encoding="utf-8") as tar:
        for name, data in (("\u00e9t\u00e9.jpg", b"\xff\xd8"), ("\u0661.cls", b"1")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    code = ("import sys, tarfile; from pathlib import Path; from largebatch.data.tar import plain_members; "
            "p = Path(sys.argv[1]); t = tarfile.open(p, 'r:'); "
            "print(sys.getfilesystemencoding(), [m.name for m in t] == [m.name for m in plain_members(p)])")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "shard.tar")], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert got == ["ascii", "True"], got


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar program (GNU tar) to write the shards")
@pytest.mark.parametrize("fmt", ["gnu", "ustar", "pax"])
def test_shards_rewritten_by_gnu_tar_pass_the_start_up_check(packed, tmp_path, fmt):
    """A shard set re-tarred by GNU tar in each of its formats: the plain layouts on the fast path, pax's extended
    headers through tarfile; the same samples either way."""
    import subprocess

    from largebatch.data.shard_check import _plain_keys, check_split

    root, index = _copy(packed, tmp_path)
    for shard in index["splits"]["train"]["shards"]:
        members = tmp_path / "members"
        members.mkdir()
        with tarfile.open(root / shard["name"]) as tar:
            names = [m.name for m in tar]
            tar.extractall(members, filter="data")
        subprocess.run(["tar", f"--format={fmt}", "-cf", str(root / shard["name"]), "-C", str(members), *names],
                       check=True)
        shutil.rmtree(members)
        keys = _tar_keys(root / shard["name"], 3)
        assert keys == _tar_keys(packed / shard["name"], 3)
        if fmt != "pax":
            assert _plain_keys(root / shard["name"], 3) == keys
    check_split(root, "train", index["splits"]["train"], 3)


def _sources(root: Path, split: str, num_classes: int = 3, on_corrupt: str = "fail") -> list[ShardSource]:
    index = json.loads((root / "index.json").read_text())
    return [ShardSource(root, index["splits"][split], num_classes=num_classes, size=16, min_scale=0.3, seed=1,
                        augment=True, workers=2, on_corrupt=on_corrupt, rank=rank, world=2) for rank in range(2)]


@pytest.mark.parametrize("split", ["train", "val"])
def test_exactly_once_or_a_sentence_when_a_shard_is_damaged_after_start_up(packed, tmp_path, split):
    """The reader (2 ranks x 2 loader workers, a full epoch, as the trainer asks) on a shard truncated after the
    start-up check: was `generator raised StopIteration` (training) or an evaluation of 10 of 16 images, exit 0."""
    root, index = _copy(packed, tmp_path)
    sources = _sources(root, split)   # built on the intact set, as after start-up
    shards = index["splits"][split]["shards"]
    # the shard read first (training reads at most the epoch's steps, so a shard at the tail may go unread)
    first = epoch_permutation(len(shards), 0, 1)[0].item() if split == "train" else 0
    victim = root / shards[first]["name"]
    _rewrite(victim, lambda ms: ms[:2])   # a whole number of samples: only the count tells
    messages = []
    for rank, src in enumerate(sources):
        if split == "train":
            steps = steps_per_epoch(37, 8)
            batches = [torch.zeros(4)] * steps
        else:
            batches = list(eval_shard(len(src), rank, 2).split(4))
        try:
            got = sum(len(y) for _, y in src.batches(batches, train=split == "train", epoch=0))
        except UserError as err:
            messages.append(str(err))
        else:
            want = 4 * len(batches) if split == "train" else len(eval_shard(len(src), rank, 2))
            assert got == want   # a rank that never reads the shard gets everything it asked for
    assert messages, "a truncated shard was read silently"
    for text in messages:
        assert f"shard {victim} holds 1 samples but index.json lists {shards[first]['count']}" in text, text


def test_the_reader_also_refuses_a_label_outside_the_classes(packed, tmp_path):
    root, _ = _copy(packed, tmp_path)
    messages = []
    for src in _sources(root, "val", num_classes=2):   # the index says 3 classes; label 2 is outside 0..1
        try:
            list(src.batches([torch.zeros(11)], train=False, epoch=0))
        except UserError as err:
            messages.append(str(err))
    assert messages and all("outside 0..1" in m for m in messages), messages


def test_corrupt_images_in_shards_are_listed_by_shard_and_key(packed, tmp_path):
    root, index = _copy(packed, tmp_path)
    name = index["splits"]["val"]["shards"][0]["name"]
    _rewrite(root / name, lambda ms: [(m, b"not a jpeg" if i == 0 else d) for i, (m, d) in enumerate(ms)])
    seen, corrupt = 0, []
    for rank, src in enumerate(_sources(root, "val", on_corrupt="skip")):
        seen += sum(len(y) for _, y in src.batches(list(eval_shard(11, rank, 2).split(4)), train=False, epoch=0))
        corrupt += src.corrupt
    first = _members_of(root, name)[0][0].name
    assert seen == 10 and corrupt == [f"{name}/{first}"]
    with pytest.raises(UserError, match=f"corrupt image {name}/{first} in the shards"):
        for rank, src in enumerate(_sources(root, "val", on_corrupt="fail")):
            list(src.batches(list(eval_shard(11, rank, 2).split(4)), train=False, epoch=0))


@pytest.mark.parametrize("dataset", ["shards", "webdataset"])
@pytest.mark.parametrize("key", ["val_split", "subset"])
def test_a_split_by_index_of_a_shard_source_is_refused(dataset, key):
    """A shard source streams its own shards and takes only the sizes of the index batches it is given, so a
    validation split or subset chosen by index would be ignored (its held-out images trained on)."""
    from largebatch import config

    with pytest.raises(UserError, match=f"^data.{key} picks images by index, which a shard source streams"):
        config.load("fashion_mnist", [f"data.dataset={dataset}", f"data.{key}=100"])


# ---- the start-up check in O(shards): the fingerprint data pack records (build 5) ---------------------------------

@pytest.fixture(scope="module")
def packed_large(tmp_path_factory) -> Path:
    """Shards of about 128 KiB (150 train samples in a few shards): larger than the 20 KiB of each shard that its
    fingerprint covers, so a start-up check that reads more than the ends shows."""
    from largebatch.data.pack import pack

    root = tmp_path_factory.mktemp("packed_large")
    _tree(root / "if", train=150, val=20)
    pack(root / "if", root / "sh", shard_bytes=128 * 1024)
    return root / "sh"


class _Reads:
    """os.pread and os.read calls of a test, in bytes returned, by file descriptor; tarfile's opens (mode 'rb')."""

    def __init__(self, monkeypatch) -> None:
        self.bytes = 0
        self.calls = 0
        pread, read = os.pread, os.read

        def counted_pread(fd, n, offset):
            data = pread(fd, n, offset)
            self.bytes += len(data)
            self.calls += 1
            return data

        def counted_read(fd, n):
            data = read(fd, n)
            self.bytes += len(data)
            self.calls += 1
            return data

        monkeypatch.setattr(os, "pread", counted_pread)
        monkeypatch.setattr(os, "read", counted_read)

        def no_tarfile(*args, **kwargs):
            raise AssertionError(f"tarfile.open{args} at start-up")

        monkeypatch.setattr(tarfile, "open", no_tarfile)


def test_the_start_up_check_reads_o_shards_bytes_no_member_header(packed_large, tmp_path, monkeypatch):
    """(a) With the fingerprints data pack records, start-up reads each shard's size, first 4 KiB and last 16 KiB:
    no header walk (neither the direct one nor tarfile's), two reads per shard, a fixed number of bytes per shard
    whatever it holds. Before build 5 every member header of every shard was read on every rank."""
    root, index = _copy(packed_large, tmp_path)
    names = [s["name"] for split in ("train", "val") for s in index["splits"][split]["shards"]]
    on_disk = sum((root / n).stat().st_size for n in names)
    assert all({"size", "max_label", "ends"} <= set(s) for split in ("train", "val")
               for s in index["splits"][split]["shards"])

    def walked(*args):
        raise AssertionError("a shard was walked at start-up")

    monkeypatch.setattr("largebatch.data.tar._plain_walk", walked)
    monkeypatch.setattr("largebatch.data.shard_check._tar_walk", walked)
    reads = _Reads(monkeypatch)
    train, test, info = build_data(DataConfig(dataset="shards", root=str(root), image_size=16), seed=0)
    assert (len(train), len(test)) == (150, 20)
    assert reads.calls == 2 * len(names), reads.calls
    assert reads.bytes <= len(names) * (4096 + 16384) < on_disk / 2, (reads.bytes, on_disk)


def test_a_shard_whose_size_differs_from_the_index_is_walked_and_named_at_start_up(packed_large, tmp_path):
    """(b) A shard cut short (another size than index.json records) is walked at start-up, alone, and is one
    sentence naming it and the fix; the other shards are not walked."""
    from largebatch.data.shard_check import check_split

    root, index = _copy(packed_large, tmp_path)
    entry = index["splits"]["train"]
    victim = root / entry["shards"][1]["name"]
    victim.write_bytes(victim.read_bytes()[: entry["shards"][1]["size"] * 2 // 3])
    with pytest.raises(UserError) as err:
        build_data(DataConfig(dataset="shards", root=str(root), image_size=16, loader_workers=0), seed=0)
    text = str(err.value)
    assert text.startswith(f"shard {victim} ") and "truncated" in text and text.endswith(
        "re-pack the ImageFolder with 'largebatch data pack'.") and "\n" not in text, text
    # Every other shard is taken on its fingerprint; a shard of another size that holds exactly its samples (zero
    # blocks appended: still a valid tar) is walked and accepted.
    root, index = _copy(packed_large, tmp_path / "again")
    entry = index["splits"]["train"]
    victim = root / entry["shards"][1]["name"]
    victim.write_bytes(victim.read_bytes() + bytes(10240))
    assert check_split(root, "train", entry, 3) == [1]
    assert check_split(root, "val", index["splits"]["val"], 3) == []


def test_an_index_listing_other_counts_or_fewer_classes_is_walked_and_named(packed_large, tmp_path):
    """The fingerprint covers index.json's count and the shard's largest label: an edited count, or a class list
    cut short, sends the shard to the walk, which names the problem."""
    root, index = _copy(packed_large, tmp_path)
    shard = index["splits"]["train"]["shards"][0]
    _edit_index(root, lambda ix: (ix["splits"]["train"]["shards"][0].update(count=shard["count"] - 1),
                                  ix["splits"]["train"]["shards"][1].update(
                                      count=ix["splits"]["train"]["shards"][1]["count"] + 1)))
    with pytest.raises(UserError, match=f"shard {root / shard['name']} holds {shard['count']} samples but index.json "
                                        f"lists {shard['count'] - 1}"):
        build_data(DataConfig(dataset="shards", root=str(root), image_size=16, loader_workers=0), seed=0)
    root, index = _copy(packed_large, tmp_path / "classes")
    _edit_index(root, lambda ix: ix.update(classes=ix["classes"][:2]))
    with pytest.raises(UserError, match="outside 0..1 \\(index.json lists 2 classes\\)"):
        build_data(DataConfig(dataset="shards", root=str(root), image_size=16, loader_workers=0), seed=0)


def test_an_index_without_fingerprints_is_walked_as_before(packed_large, tmp_path):
    """An index.json written before build 5 (counts only): every shard is walked at start-up, as before, and a
    damaged one is named there."""
    from largebatch.data.shard_check import check_split

    root, index = _copy(packed_large, tmp_path)
    _edit_index(root, lambda ix: [s.pop(k) for split in ix["splits"].values() for s in split["shards"]
                                  for k in ("size", "max_label", "ends")])
    index = json.loads((root / "index.json").read_text())
    entry = index["splits"]["train"]
    assert check_split(root, "train", entry, 3) == list(range(len(entry["shards"])))
    _rewrite(root / entry["shards"][0]["name"], _set_label(b"cat"))
    with pytest.raises(UserError, match="holds b'cat', not a class number"):
        build_data(DataConfig(dataset="shards", root=str(root), image_size=16, loader_workers=0), seed=0)


def _member_at(path: Path, lo: int, hi: int, ext: str) -> tarfile.TarInfo:
    """A member of `path` named *.ext whose data lies within bytes lo..hi."""
    with tarfile.open(path) as tar:
        return next(m for m in tar if m.name.endswith(ext) and lo <= m.offset_data and m.offset_data + m.size <= hi)


def test_damage_of_the_same_size_inside_a_shard_passes_start_up_and_the_stream_names_it(packed_large, tmp_path):
    """(c) What the fingerprint does not cover, a label byte changed in place between a shard's ends (same size,
    same ends), passes the start-up check; the loader worker that reads the sample names the shard and the
    member (one sentence, raised by the main process), never a silent wrong label."""
    root, index = _copy(packed_large, tmp_path)
    entry = index["splits"]["val"]
    victim = root / entry["shards"][0]["name"]
    assert victim.stat().st_size > 4096 + 16384
    member = _member_at(victim, 4096, victim.stat().st_size - 16384, ".cls")
    data = bytearray(victim.read_bytes())
    data[member.offset_data] = ord("x")
    victim.write_bytes(bytes(data))
    _, test, _ = build_data(DataConfig(dataset="shards", root=str(root), image_size=16, loader_workers=2), seed=0)
    with pytest.raises(UserError) as err:
        list(test.batches(list(torch.arange(20).split(4)), train=False, epoch=0))
    text = str(err.value)
    assert f"shard {victim}: label member {member.name} holds b'x" in text and "re-pack" in text, text


def test_the_stream_names_a_shard_holding_more_samples_than_listed(packed_large, tmp_path):
    """A shard found longer than its count by the stream (its index changed after start-up): one sentence, not a
    sample dropped silently."""
    root, index = _copy(packed_large, tmp_path)
    entry = index["splits"]["val"]
    entry["shards"][0]["count"] -= 1
    entry["total"] -= 1
    src = ShardSource(root, entry, num_classes=3, size=16, min_scale=0.3, seed=1, augment=False, workers=0,
                      on_corrupt="fail", rank=0, world=1)
    with pytest.raises(UserError, match=f"shard {root / entry['shards'][0]['name']} holds more than the "
                                        f"{entry['shards'][0]['count']} samples index.json lists"):
        list(src.batches(list(torch.arange(entry["total"]).split(4)), train=False, epoch=0))
