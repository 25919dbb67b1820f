"""Build the emulated kernel library from the real ``csrc/*.cu`` with g++ (tests only).

In a copy of each ``.cu`` file (and of ``glue.cpp``, which launches the emulator's
self-test kernels) every launch ``kernel<<<grid, block, shmem, stream>>>(args)`` is
rewritten to ``emu_launch("kernel", [&] { kernel(args); }, grid, block, shmem, stream)``,
keeping the line count, under a ``#line`` directive so compiler messages point at the real
file, and every ``__shared__`` array declaration is followed, on its line, by
``emu::poison_shared(&name, sizeof name);`` (fresh garbage in each block, as on a GPU; see
emu.h). Nothing else is changed. The copies are compiled with ``-include emu.h`` and this
folder's stand-in CUDA headers (``include/``) into one shared library.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

__all__ = ["HERE", "CSRC", "CXXFLAGS", "compiler", "rewrite_launches", "poison_shared_arrays", "build_library"]

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent.parent / "csrc"
CXXFLAGS = [
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-pthread",
    "-ffp-contract=off",  # no FMA contraction on any host: reproducible, and each product rounded as written
    "-Wall",
    "-Wno-unused-variable",
    "-Wno-unused-function",
]


def compiler() -> str | None:
    return shutil.which("g++")


def _code_mask(src: str) -> list[bool]:
    """True for characters outside comments and string/char literals."""
    mask = [True] * len(src)
    i, n = 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif src[i] in "\"'":
            j = i + 1
            while j < n and src[j] != src[i]:
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            mask[k] = False
        i = j
    return mask


def _match_back(src: str, end: int, open_: str, close: str) -> int:
    """Index of the `open_` that balances the `close` at src[end]."""
    depth = 0
    for i in range(end, -1, -1):
        if src[i] == close:
            depth += 1
        elif src[i] == open_:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced")


def _match_forward(src: str, start: int, open_: str, close: str) -> int:
    """Index of the `close` that balances the `open_` at src[start]."""
    depth = 0
    for i in range(start, len(src)):
        if src[i] == open_:
            depth += 1
        elif src[i] == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError("unbalanced")


_CALLEE = re.compile(r"[A-Za-z_][\w:]*\s*(<[\s\S]*>)?")


def rewrite_launches(src: str, name: str = "<source>") -> tuple[str, int]:
    """``(rewritten source, number of launches)``; ValueError on a launch it cannot parse."""
    mask = _code_mask(src)
    out, pos, count = [], 0, 0
    for m in re.finditer(r"<<<", src):
        at = m.start()
        if not mask[at] or at < pos:
            continue
        line = src.count("\n", 0, at) + 1
        try:
            # the callee: `name` or `ns::name<template args>` (possibly across lines) before <<<
            j = at - 1
            while src[j].isspace():
                j -= 1
            if src[j] == ">":
                j = _match_back(src, j, "<", ">") - 1
                while src[j].isspace():
                    j -= 1
            start = j
            while start > 0 and (src[start - 1].isalnum() or src[start - 1] in "_:"):
                start -= 1
            callee = src[start:at].strip()
            if not _CALLEE.fullmatch(callee):
                raise ValueError(f"callee {callee!r}")
            cfg_end = src.index(">>>", at + 3)
            config = src[at + 3 : cfg_end].strip()
            k = cfg_end + 3
            while src[k].isspace():
                k += 1
            if src[k] != "(":
                raise ValueError("no argument list after >>>")
            close = _match_forward(src, k, "(", ")")
        except (ValueError, IndexError) as exc:
            raise ValueError(f"{name}:{line}: cannot rewrite this kernel launch ({exc})") from None
        original = src[start : close + 1]
        new = f'emu_launch("{" ".join(callee.split())}", [&] {{ {callee}({src[k + 1 : close]}); }}, {config})'
        new += "\n" * (original.count("\n") - new.count("\n"))  # keep the line numbers
        out += [src[pos:start], new]
        pos = close + 1
        count += 1
    out.append(src[pos:])
    return "".join(out), count


_SHARED = re.compile(r"__shared__\s+[\w:<>, ]+?\s+(\w+)\s*(?:\[[^\];]*\]\s*)+;")


def poison_shared_arrays(src: str, name: str = "<source>") -> tuple[str, int]:
    """``(source, number of arrays)`` with ``emu::poison_shared(&a, sizeof a);`` after each
    ``__shared__`` array declaration ``a`` (on the same line); ValueError on a ``__shared__``
    it cannot parse (a scalar, an initialiser, ``extern``: the kernels declare none)."""
    mask = _code_mask(src)
    out, pos, count = [], 0, 0
    for m in re.finditer(r"__shared__", src):
        if not mask[m.start()]:
            continue
        decl = _SHARED.match(src, m.start())
        if decl is None:
            line = src.count("\n", 0, m.start()) + 1
            raise ValueError(f"{name}:{line}: cannot poison this __shared__ declaration (an array of fixed size?)")
        out += [src[pos : decl.end()], f" emu::poison_shared(&{decl[1]}, sizeof {decl[1]});"]
        pos = decl.end()
        count += 1
    out.append(src[pos:])
    return "".join(out), count


def _run(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def build_library(out_dir: Path, csrc: Path = CSRC, cxx: str | None = None) -> Path:
    """Compile the emulated library into ``out_dir``; returns the ``.so``. RuntimeError with the
    compiler's output on failure."""
    cxx = cxx or compiler()
    if cxx is None:
        raise FileNotFoundError("g++ not found")
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = sorted(csrc.glob("*.cu"))
    if not sources:
        raise RuntimeError(f"no .cu files in {csrc}")
    units = []
    for src in [*sources, HERE / "glue.cpp"]:  # glue.cpp launches the emulator's self-test kernels
        rewritten, _ = rewrite_launches(src.read_text(), src.name)  # a launch left over would not compile
        rewritten, _ = poison_shared_arrays(rewritten, src.name)
        unit = out_dir / (src.stem + ".emu.cpp")
        unit.write_text(f'#line 1 "{src}"\n' + rewritten)
        units.append(unit)
    flags = [*CXXFLAGS, f"-I{HERE / 'include'}", f"-I{csrc}", "-include", str(HERE / "emu.h")]
    procs = [(u, _run([cxx, *flags, "-c", str(u), "-o", str(out_dir / (u.stem + ".o"))], out_dir)) for u in units]
    errors = []
    for unit, proc in procs:
        output, _ = proc.communicate()
        if proc.returncode != 0:
            errors.append(f"{unit.name}:\n{output}")
    if errors:
        raise RuntimeError("emulated CUDA kernels do not compile with g++:\n" + "\n".join(errors)[-6000:])
    lib = out_dir / "libfgd_cuda_emu.so"
    link = _run([cxx, "-shared", "-pthread", "-o", str(lib), *(str(out_dir / (u.stem + ".o")) for u in units)], out_dir)
    output, _ = link.communicate()
    if link.returncode != 0:
        raise RuntimeError(f"linking the emulated CUDA kernels failed:\n{output[-6000:]}")
    return lib
