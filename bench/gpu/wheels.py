#!/usr/bin/env python3
"""Fill the git-ignored .whl/ with the wheels the GPU benchmark installs there (no network there).

    python3 bench/gpu/wheels.py [--dest .whl] [--check-only]

What it does, in the repository whose root holds this script:

1. every pin of bench/gpu/wheels.txt: copied from the local wheelhouse
   ($LLAMA_CLUSTER_CACHE/wheelhouse/cp311-pypi) when that holds a wheel for any Python
   (py3-none-any, abi3), else downloaded from PyPI for CPython 3.12 on manylinux x86-64;
2. DeepSpeed, which PyPI has only as an sdist: built here with DS_BUILD_OPS=0 DS_ACCELERATOR=cuda
   (no compiled ops; they compile on first use), in the wheelhouse's build environment;
3. checks: one version of each package; every dependency of every carried wheel (markers read for
   CPython 3.12 on Linux) is carried or in the image (bench/gpu/image_packages.txt), at a version
   that satisfies it where the image's version is known;
4. prints the size of what a device call sends: the working tree (tracked and untracked files that
   git does not ignore) plus the carried paths (.whl, and .cache/collections: the third-party
   collections), against the 64 MiB limit.

Exit status 1 when a check fails or the total is over the limit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIMIT_BYTES = 64 * 2**20
PLATFORMS = [
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux1_x86_64",
]
# Wheel tags that CPython 3.12 on x86-64 Linux installs (the GPU machine's interpreter).
TARGET_TAGS = {
    *cpython_tags((3, 12), abis=["cp312", "abi3", "none"], platforms=PLATFORMS),
    *compatible_tags((3, 12), interpreter="cp312", platforms=PLATFORMS),
}
# Dependencies of LLaMA-Factory that training does not import (the web UI, the API server, video
# input, other hubs); ENVIRONMENT.md: "gradio, av, modelscope, fastapi and uvicorn are not needed
# to train". They are left behind, so the carried wheels stay small.
NOT_NEEDED = {"av", "fastapi", "gradio", "hf-transfer", "modelscope", "sse-starlette", "uvicorn"}
# The GPU machine's interpreter, for the markers of Requires-Dist.
TARGET_ENV = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}


def read_pins(path: Path) -> list[Requirement]:
    """The name==version lines of wheels.txt."""
    pins = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            pins.append(Requirement(line))
    return pins


def pinned_version(req: Requirement) -> str:
    """The exact version of a `name==version` pin."""
    (spec,) = tuple(req.specifier)
    return spec.version


def installable(path: Path) -> bool:
    """True for a wheel made for CPython 3.12 on x86-64 Linux.

    Stricter than pip: a wheel tagged for one other Python (multiprocess's py311) installs on
    3.12 but carries that version's code, so only py3, py312/cp312 and abi3 wheels count.
    """
    _, _, _, tags = parse_wheel_filename(path.name)
    return any(
        tag in TARGET_TAGS and (tag.interpreter in ("py3", "py312", "cp312") or tag.abi == "abi3")
        for tag in tags
    )


def local_wheel(wheelhouse: Path, req: Requirement) -> Path | None:
    """A wheel of exactly this pin for CPython 3.12 in the local wheelhouse, if there is one."""
    if not wheelhouse.is_dir():
        return None
    want = (canonicalize_name(req.name), Version(pinned_version(req)))
    for path in sorted(wheelhouse.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        if (name, version) == want and installable(path):
            return path
    return None


def download(req: Requirement, dest: Path) -> None:
    """Download the cp312 manylinux (or pure) wheel of one pin from PyPI."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    cmd += ["--abi", "cp312", "--abi", "abi3", "--abi", "none"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, "--dest", str(dest), str(req)], check=True)


def build_deepspeed(req: Requirement, dest: Path, cache: Path) -> None:
    """Build DeepSpeed's wheel from its sdist without compiled ops."""
    version = pinned_version(req)
    sdist = cache / "wheelhouse" / "cp311-pypi" / "src" / f"deepspeed-{version}.tar.gz"
    with tempfile.TemporaryDirectory() as tmp:
        if not sdist.exists():
            pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
            subprocess.run([*pip, "--no-binary", ":all:", "--dest", tmp, str(req)], check=True)
            sdist = Path(tmp) / f"deepspeed-{version}.tar.gz"
        build_venv = cache / "wheelhouse" / ".build-venv"
        pip = (
            [str(build_venv / "bin" / "pip")]
            if build_venv.is_dir()
            else [sys.executable, "-m", "pip"]
        )
        env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}
        subprocess.run(
            [
                *pip,
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(dest),
                str(sdist),
            ],
            check=True,
            env=env,
        )


# bitsandbytes ships one library per CUDA release (130 MB unpacked, 43 MB zipped); the image's
# torch is built for CUDA 13.0, so only that one (and the CPU fallback) travels.
BNB_KEEP = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")


def slim_bitsandbytes(wheel: Path) -> None:
    """Rewrite the bitsandbytes wheel with only the native libraries the GPU machine loads
    (its RECORD rewritten to match, so pip installs it as it would the original)."""
    with zipfile.ZipFile(wheel) as src:
        names = [
            n
            for n in src.namelist()
            if not (n.endswith(".so") and Path(n).name.startswith("libbitsandbytes_"))
            or Path(n).name in BNB_KEEP
        ]
        if len(names) == len(src.namelist()):
            return
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        kept = set(names)
        lines = [
            line for line in src.read(record).decode().splitlines() if line.split(",", 1)[0] in kept
        ]
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
            for name in names:
                data = "\n".join(lines) + "\n" if name == record else src.read(name)
                out.writestr(src.getinfo(name), data)
    tmp.replace(wheel)


def fill(dest: Path, pins: list[Requirement], cache: Path) -> None:
    """Put one wheel per pin into dest (keeping the ones already there)."""
    dest.mkdir(parents=True, exist_ok=True)
    have = {}
    for path in dest.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        if installable(path):
            have[name] = str(version)
    wheelhouse = cache / "wheelhouse" / "cp311-pypi"
    for req in pins:
        name = canonicalize_name(req.name)
        if have.get(name) == pinned_version(req):
            continue
        if name == "deepspeed":
            build_deepspeed(req, dest, cache)
            source = "built (DS_BUILD_OPS=0)"
        elif (found := local_wheel(wheelhouse, req)) is not None:
            shutil.copy2(found, dest / found.name)
            source = f"copied from {wheelhouse}"
        else:
            download(req, dest)
            source = "downloaded (cp312)"
        print(f"{req}: {source}")
    for wheel in dest.glob("bitsandbytes-*.whl"):
        slim_bitsandbytes(wheel)


def requires(path: Path) -> list[Requirement]:
    """Requires-Dist of a wheel that apply on the GPU machine (no extras)."""
    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        text = whl.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(TARGET_ENV):
                reqs.append(req)
    return reqs


def read_image(path: Path) -> dict[str, str]:
    """Package name -> version ('' when unknown) of the GPU machine's image."""
    image = {}
    for raw in path.read_text().splitlines():
        if raw.strip() and not raw.startswith("#"):
            name, _, version = raw.partition(" ")
            image[canonicalize_name(name)] = version.strip()
    return image


def check(dest: Path, pins: list[Requirement], image: dict[str, str]) -> list[str]:
    """Problems with the carried set: duplicates, missing pins, unmet dependencies."""
    problems = []
    carried: dict[str, list[str]] = {}
    wheels = sorted(dest.glob("*.whl"))
    for path in wheels:
        name, version, _, _ = parse_wheel_filename(path.name)
        carried.setdefault(name, []).append(str(version))
    problems += [f"{p.name}: not installable by CPython 3.12" for p in wheels if not installable(p)]
    for name, versions in carried.items():
        if len(versions) > 1:
            problems.append(f"{name}: several versions carried ({', '.join(versions)}); keep one")
    for req in pins:
        if canonicalize_name(req.name) not in carried:
            problems.append(f"{req}: not in {dest}")
    for path in wheels:
        owner = parse_wheel_filename(path.name)[0]
        for req in requires(path):
            name = canonicalize_name(req.name)
            if owner == "llamafactory" and name in NOT_NEEDED:
                continue
            if name in carried:
                version = carried[name][0]
                where = "carried"
            elif name in image:
                version = image[name]
                where = "image"
            else:
                problems.append(f"{owner} needs {req}: neither carried nor in the image")
                continue
            if version and req.specifier and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{owner} needs {req}: the {where} has {name} {version}")
    return problems


def travelling_bytes(root: Path, carried: list[Path]) -> tuple[int, int]:
    """Bytes of the working tree that a device call sends, and of the carried paths."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    tree = 0
    for rel in filter(None, listed):
        path = root / rel.decode()
        if path.is_file() and not path.is_symlink():
            tree += path.stat().st_size
    extra = 0
    for top in carried:
        for path in [top, *top.rglob("*")] if top.is_dir() else [top]:
            if path.is_file() and not path.is_symlink():
                extra += path.stat().st_size
    return tree, extra


def main() -> int:
    """Fill, check and measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--check-only", action="store_true", help="fill nothing, only check")
    args = parser.parse_args()
    cache = Path(os.environ.get("LLAMA_CLUSTER_CACHE", Path.home() / ".cache" / "llama-cluster"))
    pins = read_pins(HERE / "wheels.txt")
    if not args.check_only:
        fill(args.dest, pins, cache)
    problems = check(args.dest, pins, read_image(HERE / "image_packages.txt"))
    for problem in problems:
        print(f"PROBLEM: {problem}")
    wheels = sorted(args.dest.glob("*.whl"))
    whl_bytes = sum(p.stat().st_size for p in wheels)
    carried = [args.dest, ROOT / ".cache" / "collections"]
    tree, extra = travelling_bytes(ROOT, [p.resolve() for p in carried if p.exists()])
    total = tree + extra
    print(f"{len(wheels)} wheels, {whl_bytes / 2**20:.1f} MiB in {args.dest}")
    print(
        f"a device call sends {total / 2**20:.1f} MiB: working tree {tree / 2**20:.1f} MiB"
        f" + carried {' '.join(os.path.relpath(p, ROOT) for p in carried)} {extra / 2**20:.1f} MiB"
        f" (limit {LIMIT_BYTES / 2**20:.0f} MiB)"
    )
    if total > LIMIT_BYTES:
        print("PROBLEM: over the device tool's 64 MiB limit")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
