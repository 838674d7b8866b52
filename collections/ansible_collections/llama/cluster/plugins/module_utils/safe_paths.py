"""Paths that root walks, writes and changes without following a link that another account
could have planted (llama_files: a run's directory belongs to the training account).

A path is walked from / one directory at a time, each opened with O_NOFOLLOW and the next looked
up in it; a link is followed only where it sits in a directory that only root (or this
process's user) can write, where only root could have made it (/opt -> /data/opt); anywhere else
it is refused, named. What is then done is done through descriptors (fchown, fchmod, openat,
renameat), so a path swapped for a link while it is being worked on is never followed either;
and a regular file with more than one hard link never gets an owner or a mode changed.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # as the kernel's own limit on links in one path


def octal_mode(mode: object) -> int | None:
    """An octal mode's value ('0750'), None for anything else."""
    text = str(mode)
    if not text or any(c not in "01234567" for c in text) or len(text) > 4:
        return None
    return int(text, 8)


class Refused(Exception):
    """A path that is not written through; the message names it and why."""


class Missing(Refused):
    """A directory on the way is not there (and was not to be made)."""


def path_parts(path: str) -> list[str]:
    """The components of a path (no empty ones, no '.')."""
    return [p for p in path.split("/") if p and p != "."]


def trusted(info: os.stat_result) -> bool:
    """Whether only root (or this process's user) can change a directory's entries: a link in
    it was made by one of them."""
    owners = {0, os.geteuid()}
    return info.st_uid in owners and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def who_can_write(info: os.stat_result) -> str:
    """Who besides its owner can write a directory, for a refusal's message."""
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    if info.st_mode & stat.S_IWOTH:
        return "every account"
    if info.st_mode & stat.S_IWGRP:
        try:
            return f"the group {grp.getgrgid(info.st_gid).gr_name}"
        except KeyError:
            return f"the group {info.st_gid}"
    return owner


class Walk:
    """A directory reached from / one component at a time, as a descriptor (`fd`)."""

    def __init__(self, path: str, *, make: bool, check_mode: bool) -> None:
        self.path = path
        self.make = make  # make missing directories (0755, this user's)
        self.check_mode = check_mode
        self.made: list[str] = []  # directories made on the way
        self.missing = False  # in check mode: a directory on the way is not there yet
        self.fd = -1

    def open(self) -> Walk:
        """Reach the directory; raises Refused for a link nobody but root may have made, or
        something on the path that is not a directory."""
        stack = [os.open("/", DIRECTORY)]
        shown: list[str] = []  # the path walked so far, for messages
        todo = path_parts(self.path)
        links = 0
        try:
            while todo:
                name = todo.pop(0)
                if name == "..":  # only in a link's target (entries refuse '..')
                    if len(stack) > 1:
                        os.close(stack.pop())
                        shown.pop()
                    continue
                here = "/" + "/".join([*shown, name])
                info = self._entry(stack[-1], name, here)
                if info is None:  # check mode: nothing below a directory still to make exists
                    self.missing = True
                    break
                if stat.S_ISLNK(info.st_mode):
                    links += 1
                    todo[:0] = self._link(stack, shown, name, here, links)
                    continue
                if not stat.S_ISDIR(info.st_mode):
                    raise Refused(f"{here} is not a directory")
                stack.append(os.open(name, DIRECTORY, dir_fd=stack[-1]))
                shown.append(name)
        except BaseException:
            for fd in stack:
                os.close(fd)
            raise
        self.fd = stack.pop()
        for fd in stack:
            os.close(fd)
        return self

    @staticmethod
    def _link(stack: list[int], shown: list[str], name: str, here: str, links: int) -> list[str]:
        """The components a link in stack[-1] stands for, where only root could have made it
        (an absolute target starts again from /: the stack is cut back to it)."""
        parent = os.fstat(stack[-1])
        if not trusted(parent):
            raise Refused(
                f"{here} is a link, in a directory that {who_can_write(parent)} can write: "
                "refused, never followed (remove it; nothing was written there)"
            )
        if links > MAX_LINKS:
            raise Refused(f"{here}: too many links")
        target = os.readlink(name, dir_fd=stack[-1])
        if target.startswith("/"):
            for fd in stack[1:]:
                os.close(fd)
            del stack[1:]
            shown.clear()
        return path_parts(target)

    def _entry(self, parent: int, name: str, here: str) -> os.stat_result | None:
        """The entry `name` of the directory `parent` (not followed); made where missing."""
        while True:
            try:
                return os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                if self.check_mode:  # an earlier entry may make it
                    return None
                if not self.make:
                    raise Missing(f"{here} does not exist") from None
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
                self.made.append(here)
            except FileExistsError:
                continue  # made in between: look again

    def close(self) -> None:
        """Close the directory's descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@contextmanager
def directory(path: str, *, make: bool = False, check_mode: bool = False) -> Iterator[Walk]:
    """The directory at `path`, reached safely (Walk), closed afterwards."""
    walk = Walk(path, make=make, check_mode=check_mode).open()
    try:
        yield walk
    finally:
        walk.close()


def owner_ids(entry: dict[str, Any]) -> tuple[int, int]:
    """The entry's owner and group as numbers (-1: leave as it is)."""
    uid = gid = -1
    owner, group = entry.get("owner"), entry.get("group")
    try:
        if owner is not None:
            uid = int(owner) if str(owner).isdigit() else pwd.getpwnam(str(owner)).pw_uid
        if group is not None:
            gid = int(group) if str(group).isdigit() else grp.getgrnam(str(group)).gr_gid
    except KeyError as err:
        raise Refused(f"{entry['path']}: no such user or group {err.args[0]!r}") from err
    return uid, gid


def differs(fd: int, entry: dict[str, Any]) -> bool:
    """Whether the owner, group or mode of an open file differ from the entry's."""
    info = os.fstat(fd)
    uid, gid = owner_ids(entry)
    mode = octal_mode(entry["mode"]) if entry.get("mode") is not None else None
    return (
        uid not in (-1, info.st_uid)
        or gid not in (-1, info.st_gid)
        or (mode is not None and stat.S_IMODE(info.st_mode) != mode)
    )


def linked_elsewhere(fd: int) -> int:
    """How many names a regular file has beyond one (0 for a directory or a file of one name):
    a hard link another account made to a file of root's (or anyone's) is another name of it."""
    info = os.fstat(fd)
    return info.st_nlink - 1 if stat.S_ISREG(info.st_mode) else 0


def set_attributes(fd: int, entry: dict[str, Any]) -> bool:
    """Set owner, group and mode through the descriptor; whether anything changed. A file with
    more than one link is refused, never changed: its other name could be any file on this
    filesystem (/etc/shadow, another run's key)."""
    if not differs(fd, entry):
        return False
    if linked_elsewhere(fd):
        raise Refused(
            f"{entry.get('path', 'a file')} has {linked_elsewhere(fd) + 1} links (names): root "
            "never changes the owner or mode of a file with more than one (remove it)"
        )
    uid, gid = owner_ids(entry)
    os.fchown(fd, uid, gid)
    if entry.get("mode") is not None:
        os.fchmod(fd, octal_mode(entry["mode"]) or 0)
    return True


def split_path(path: str) -> tuple[str, str]:
    """A path's directory and last component."""
    parent, _, name = path.rstrip("/").rpartition("/")
    return parent or "/", name
