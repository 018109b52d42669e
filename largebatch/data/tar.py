"""The tar members of a shard, for both shard layouts (`data pack`'s, largebatch/data/shards.py; WebDataset's
as published, largebatch/data/wds.py): the one place that reads tar headers.

1. Through tarfile, damage as one sentence naming the shard: `open_shard` (an uncompressed tar and its size),
   `members` (its headers, one at a time), `read_member` (a member's bytes). This reads any tar layout and
   names what is wrong with a damaged one.
2. Directly, for the plain ustar layout that tar writers produce (`data pack`'s, webdataset's ShardWriter's,
   GNU tar's): `plain_members` reads every header with about one `pread` per member, 51-58k samples/s against
   tarfile's 9-11k (scripts/shard_walk_cost.py, results/reliability/shard_walk.log), and `PlainReader` reads
   the members' bytes. It accepts only what tarfile reads the same way; anything else raises `Unusual`, and the
   caller walks the shard through tarfile (1), which names the problem or reads the unusual layout.

`INDEX` and `FIX` are the shard set's index file and the repair its sentences name by default (each caller with
another repair passes its own `fix`).
"""
from __future__ import annotations

import os
import re
import stat
import tarfile
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from largebatch.errors import UserError, os_error_fix, shown

INDEX = "index.json"
FIX = "re-pack the ImageFolder with 'largebatch data pack'"


def members(tar: tarfile.TarFile, where: str, fix: str = FIX) -> Iterator[tarfile.TarInfo]:
    """The members of an open shard, one header at a time; a damaged header is one sentence ending in `fix`."""
    it, count = iter(tar), 0
    while True:
        try:
            member = next(it)
        except StopIteration:
            return
        except (tarfile.TarError, ValueError) as err:   # ValueError: a header's offsets beyond a file's
            raise UserError(f"shard {where} is damaged after {count} members ({err}); {fix}.") from None
        if member.size < 0:   # base-256 size field: tarfile reads a header again (-512: forever) or fails to seek
            raise UserError(f"shard {where} has a member {shown(member.name)} with a negative size "
                            f"({member.size}); {fix}.")
        count += 1
        yield member


def read_member(tar: tarfile.TarFile, where: str, member: tarfile.TarInfo, fix: str = FIX) -> bytes:
    """A regular member's bytes (the callers keep only those); a tar error is one sentence naming the shard
    `where`, the member and `fix`."""
    try:
        f = tar.extractfile(member)
        assert f is not None, "a regular file (checked by the caller)"
        return f.read()
    except (OSError, tarfile.TarError) as err:
        raise UserError(f"shard {where}: cannot read member {shown(member.name)} ({err}); {fix}.") from None


def open_shard(path: Path) -> tuple[tarfile.TarFile, int]:
    """An uncompressed tar open for reading, and its size in bytes; a file that is none is one sentence."""
    try:
        size = os.stat(path).st_size
        if size == 0:
            raise UserError(f"shard {shown(path)} is empty (0 bytes); copy it again or {FIX}.")
        return tarfile.open(path, "r:"), size
    except FileNotFoundError:
        raise UserError(f"shard {shown(path)} listed in {INDEX} is missing; copy it or {FIX}.") from None
    except tarfile.TarError as err:
        raise UserError(f"shard {shown(path)} is not an uncompressed tar archive ({err}); copy it again or "
                        f"{FIX}.") from None
    except IsADirectoryError:
        raise UserError(f"shard {shown(path)} is a directory (Is a directory), not a tar file; copy the shard "
                        f"file there again or {FIX}.") from None
    except OSError as err:
        raise UserError(f"cannot read shard {shown(path)} ({err.strerror or err}); {os_error_fix(err)}.") from None


class Unusual(Exception):
    """The direct header walk met something outside the plain layout; the tarfile walk decides."""


class PlainMember(NamedTuple):
    """A regular member as `plain_members` reads it: what tarfile's TarInfo says of it (its `name` decoded
    as tarfile decodes it), and the first bytes of its data, read with its header."""
    name: str
    offset_data: int
    size: int
    head: bytes

    def isreg(self) -> bool:
        return True


# The fixed-width ustar fields as Python's tarfile (`data pack`, webdataset's writer) and GNU tar write them, at
# 100:157 of a header: mode, uid, gid as 7 octal digits, size and mtime as 11, each ended by NUL or space, the
# checksum as 6 digits, NUL, space, and the type: '0' or NUL (a file) or 'x' (a pax header for the next);
# at 329:346 devmajor and devminor (octal or empty) and the first byte of an empty name prefix.
_PLAIN_FIELDS = re.compile(rb"[0-7]{7}[\0 ][0-7]{7}[\0 ][0-7]{7}[\0 ]([0-7]{11})[\0 ][0-7]{11}[\0 ][0-7]{6}\0 ([0\0x])")
_PLAIN_DEV = re.compile(rb"(?:[0-7]{7}[\0 ]|\0{8}){2}\0")
_PAX_TIME = re.compile(rb"(\d+) [acm]time=-?\d+(?:\.\d+)?\n")   # a pax record that names no path and no size
_ZERO_BLOCK = bytes(512)


def plain_members(path: Path) -> list[PlainMember]:
    """Every member of an uncompressed tar, read from its headers directly: about one `pread` per member, a
    few times faster than tarfile's walk, for the plain layout that tar writers produce.

    It accepts only what tarfile reads the same way: regular members with octal fields, an unsigned checksum
    that holds, no name prefix and no GNU extension, pax headers only of times (mtime, atime, ctime: what
    webdataset's writer adds to each member), the archive ending in a zero block or at the end of the file
    with every member whole. Anything else, damage included, raises Unusual, and the caller walks the shard
    with tarfile, which names the problem or reads the unusual layout.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # O_NONBLOCK: a FIFO named like a shard must not block
    except OSError:
        raise Unusual from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            raise Unusual                  # a directory, a FIFO, a device, an empty file: tarfile's walk names it
        return _plain_walk(fd, info.st_size)
    except OSError:
        raise Unusual from None
    finally:
        os.close(fd)


def _plain_walk(fd: int, size: int) -> list[PlainMember]:
    members: list[PlainMember] = []
    heads: list[bytes] = []                # every header's checksum, checked at the end, all at once
    sums: list[int] = []
    off, pax = 0, False
    while off < size:
        block = os.pread(fd, 1024, off)
        head = block[:512]                 # a header cut short cannot pass `off > size` below
        if head == _ZERO_BLOCK:
            break                          # the end of the archive (tarfile stops at the first zero block)
        fields = _PLAIN_FIELDS.fullmatch(head, 100, 157)
        if fields is None or _PLAIN_DEV.fullmatch(head, 329, 346) is None:
            raise Unusual
        heads.append(head)
        sums.append(int(head[148:154], 8))
        n = int(fields[1], 8)
        data = off + 512
        off = data + -(-n // 512) * 512
        if off > size:
            raise Unusual                  # a member or its padding runs past the end
        if fields[2] == b"x":              # pax records of times alone, NUL padding: they change no offset
            if pax or n > 512 or block[512 + n:1024].strip(b"\0"):
                raise Unusual
            pos = 512
            while pos < 512 + n:
                record = _PAX_TIME.match(block, pos, 512 + n)
                if record is None or int(record[1]) != record.end() - pos:
                    raise Unusual
                pos = record.end()
            pax = True
            continue
        end = head.find(b"\0", 0, 100)
        name = head[:100 if end < 0 else end].decode(tarfile.ENCODING, "surrogateescape")   # as tarfile does
        if name.endswith("/") and fields[2] == b"\0":
            raise Unusual                  # tarfile reads this as a directory
        members.append(PlainMember(name, data, n, block[512:512 + n]))
        pax = False
    if pax:
        raise Unusual                      # a pax header with no member after it
    if heads:
        blocks = np.frombuffer(b"".join(heads), np.uint8).reshape(-1, 512)
        got = blocks.sum(1, dtype=np.int64) - blocks[:, 148:156].sum(1, dtype=np.int64) + 256
        if not np.array_equal(got, np.asarray(sums, dtype=np.int64)):
            raise Unusual
    return members


class PlainReader:
    """`read_member` for `plain_members`'s members of one shard: a member's bytes from those read with its header
    where they are all there, else by `pread` on one descriptor, opened at the first such member and held to
    the end of the `with` block; `read_member`'s sentence when the file cannot be read or has changed."""

    def __init__(self, path: Path, where: str, fix: str = FIX) -> None:
        self.path, self.where, self.fix, self.fd = path, where, fix, -1

    def __enter__(self) -> PlainReader:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __call__(self, member: PlainMember) -> bytes:
        if member.size <= len(member.head):
            return member.head[:member.size]
        try:
            if self.fd < 0:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)   # a FIFO put there since must not block
            data = os.pread(self.fd, member.size, member.offset_data)
        except OSError as err:
            raise UserError(f"shard {self.where}: cannot read member {shown(member.name)} ({err}); "
                            f"{self.fix}.") from None
        if len(data) != member.size:
            raise UserError(f"shard {self.where}: cannot read member {shown(member.name)} (the file ends after "
                            f"{len(data)} of its {member.size} bytes); {self.fix}.")
        return data
