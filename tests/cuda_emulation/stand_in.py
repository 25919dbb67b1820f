"""A ctypes stand-in for ``fgd_fast._C`` over the emulated kernels, and a private instance of
``fgd_fast/backends/cuda.py`` that uses it on CPU tensors (tests only)."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import weakref
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["EmulatedExtension", "load_backend", "guards_intact"]

_LL, _ULL, _I, _P = ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_void_p
_GUARD_BYTES = 512  # at least this much guard band before every fenced buffer
# the guard band's bit pattern, per element size: a NaN in every float format (a kernel that
# reads it spreads NaN into its result; one that writes over it changes the bits)
_PATTERN = {2: 0x7E5A, 4: 0x7FC0DEAD, 8: 0x7FF8DEADBEEF0BAD}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def guards_intact(t: torch.Tensor) -> bool:
    """Whether the guard band before a fenced tensor (see EmulatedExtension.fenced) still
    holds its pattern. (Past the end there is no band but an inaccessible page.)"""
    size = t.element_size()
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).view(_INT[size])
    band = flat[: t.storage_offset()]
    # (torch.equal, not bool(tensor): a test that forbids the step's host reads patches those)
    return torch.equal(band, torch.full_like(band, _PATTERN[size]))


class EmulatedExtension(ModuleType):
    """``fgd_fast._C`` with the emulated kernels: the same functions and argument checks as
    ``csrc/fgd_binding.cpp``, on CPU tensors. Beyond the binding, every buffer it hands a
    kernel is a *fenced* copy (it ends at an inaccessible page, so a read or write past its end
    fails the launch with "illegal address", and a guard band before it must stay intact),
    outputs and scratch are NaN-filled first (an element a kernel never writes spreads NaN),
    and the read-only tables must be unchanged afterwards."""

    def __init__(self, library: Path):
        super().__init__("fgd_fast._C", "emulated fgd_fast CUDA kernels (tests/cuda_emulation)")
        # PyDLL: calls keep the GIL, so if something crashes the process after all, Python's
        # faulthandler can still print the test's traceback
        lib = self.lib = ctypes.PyDLL(str(library))
        sig = {
            "fgd_gram_launch": ([_I, _P, _I, _P, _LL, _LL, _I, _P], _I),
            "fgd_sum_splits_launch": ([_I, _P, _P, _LL, _I, _P], _I),
            "fgd_update_launch": ([_I, _P, _P, _I, _P, _P, _LL, _I, _LL, _P], _I),
            "fgd_emu_constants_json": ([], ctypes.c_char_p),
            "fgd_emu_last_message": ([], ctypes.c_char_p),
            "fgd_emu_clear_error": ([], None),
            "fgd_emu_fenced_alloc": ([_ULL, _ULL, ctypes.POINTER(_ULL), ctypes.POINTER(_ULL)], _P),
            "fgd_emu_fenced_free": ([_ULL, _ULL], None),
            "fgd_emu_set_reverse_schedule": ([_I], None),
            "fgd_emu_use_ucontext": ([_I], _I),
            "fgd_emu_set_launch_timeout": ([ctypes.c_double], ctypes.c_double),
            "fgd_emu_stats": ([_P], None),
            "fgd_emu_selftest": ([_I, _P, _P, _I, _I], _I),
            "fgd_emu_float_to_half": ([_P, _P, _LL], None),
            "fgd_emu_half_to_float": ([_P, _P, _LL], None),
            "fgd_emu_float_to_bfloat16": ([_P, _P, _LL], None),
            "fgd_emu_bfloat16_to_float": ([_P, _P, _LL], None),
        }
        for name, (args, res) in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._k = k = json.loads(lib.fgd_emu_constants_json().decode())
        self._acc = {
            k["F32"]: torch.float32,
            k["F16"]: torch.float32,
            k["BF16"]: torch.float32,
            k["F64"]: torch.float64,
        }

    # ---- the binding's API

    def constants(self) -> dict:
        return json.loads(json.dumps(self._k))  # a fresh copy, as the binding returns a new dict

    def synchronize(self, like: torch.Tensor) -> None:  # launches are synchronous here
        pass

    def gram(self, meta, partial, gram_total, total_tiles, splits, dtype):
        self._check_meta(meta)
        self._check_acc(partial, dtype, splits * gram_total, "partial")
        m, out = self.fenced(meta), self.fenced(partial, nan=True)
        self._launch(
            "Gram kernel launch",
            self.lib.fgd_gram_launch,
            [m, out],
            [(m, meta)],
            dtype,
            m.data_ptr(),
            meta.shape[0],
            out.data_ptr(),
            gram_total,
            total_tiles,
            splits,
            None,
        )
        partial.copy_(out)

    def sum_splits(self, partial, out, total, splits):
        if not (
            partial.device.type == out.device.type == "cpu"
            and partial.dtype == out.dtype
            and out.dtype in (torch.float32, torch.float64)
            and partial.is_contiguous()
            and out.is_contiguous()
            and out.numel() >= total
            and partial.numel() >= splits * total
        ):
            raise RuntimeError(
                f"sum_splits needs contiguous float32/float64 CPU tensors of {splits} × {total} and {total} elements"
            )
        src, dst = self.fenced(partial), self.fenced(out, nan=True)
        self._launch(
            "split reduction launch",
            self.lib.fgd_sum_splits_launch,
            [src, dst],
            [(src, partial)],
            int(out.dtype == torch.float64),
            src.data_ptr(),
            dst.data_ptr(),
            total,
            splits,
            None,
        )
        out.copy_(dst)

    def update(self, meta, hyper, mats, scratch, total_blocks, grid, p_max, dtype):
        self._check_meta(meta)
        self._check_acc(hyper, dtype, 3 * meta.shape[0], "hyper")
        self._check_acc(mats, dtype, 0, "mats")
        self._check_acc(scratch, dtype, grid * self._k["UPD_ROWS"] * p_max, "scratch")
        if not 1 <= grid <= 2**31 - 1:
            raise RuntimeError(f"bad update grid {grid}")
        m, h, mm, snap = self.fenced(meta), self.fenced(hyper), self.fenced(mats), self.fenced(scratch, nan=True)
        self._launch(
            "update kernel launch",
            self.lib.fgd_update_launch,
            [m, h, mm, snap],
            [(m, meta), (h, hyper), (mm, mats)],
            dtype,
            m.data_ptr(),
            h.data_ptr(),
            meta.shape[0],
            mm.data_ptr(),
            snap.data_ptr(),
            total_blocks,
            grid,
            p_max,
            None,
        )

    # ---- fenced memory

    def fenced(self, t: torch.Tensor, nan: bool = False) -> torch.Tensor:
        """A copy of ``t`` (same shape and values — NaN instead when ``nan`` —, same strides
        when ``t`` is dense in some order of its dimensions (contiguous, channels_last, a
        transpose), else contiguous) whose last element is followed by an inaccessible page and
        whose storage begins with a guard band (see :func:`guards_intact`). The memory is
        unmapped when the tensor is gone."""
        order = sorted(range(t.dim()), key=t.stride, reverse=True)
        if not t.permute(order).is_contiguous():  # (gaps or overlaps)
            t = t.contiguous()
        size = t.element_size()
        nbytes = max(t.numel(), 1) * size
        base, length = _ULL(), _ULL()
        data = self.lib.fgd_emu_fenced_alloc(nbytes, _GUARD_BYTES, ctypes.byref(base), ctypes.byref(length))
        if not data:
            raise MemoryError("emulator: cannot map fenced memory")
        usable = data + nbytes - base.value  # from the mapping's start to the fence

        class Mapping(ctypes.c_char * usable):  # a Python subclass, so it can carry a finalizer
            pass

        buf = Mapping.from_address(base.value)
        weakref.finalize(buf, self.lib.fgd_emu_fenced_free, base.value, length.value)
        storage = torch.frombuffer(buf, dtype=_INT[size]).fill_(_PATTERN[size]).view(t.dtype)  # keeps buf alive
        out = storage.as_strided(t.shape, t.stride(), (data - base.value) // size)
        if nan:
            out.fill_(float("nan"))
        else:
            out.copy_(t)
        return out

    # ---- emulator controls, for the tests

    def set_reverse_schedule(self, reverse: bool) -> None:
        self.lib.fgd_emu_set_reverse_schedule(int(reverse))

    def use_ucontext(self, on: bool) -> bool:
        """Switch fibers with ucontext instead of the assembly switch (where that exists);
        returns the previous setting."""
        return bool(self.lib.fgd_emu_use_ucontext(int(on)))

    def set_launch_timeout(self, seconds: float) -> float:
        """Seconds after which a launch is interrupted (cudaErrorLaunchTimeout); returns the
        previous value."""
        return self.lib.fgd_emu_set_launch_timeout(seconds)

    def stats(self) -> dict:
        out = (ctypes.c_longlong * 3)()
        self.lib.fgd_emu_stats(out)
        return dict(zip(("launches", "blocks", "barriers"), out))

    def selftest(self, which: str, blocks: int, threads: int) -> tuple[int, str, torch.Tensor]:
        """Run one of glue.cpp's self-test kernels on fenced buffers of blocks × threads
        floats (input 0, 1, 2, …): ``(error code, message, output)``."""
        code = {
            "exchange": 0,
            "exchange-without-barrier": 1,
            "divergent-barrier": 2,
            "read-past-end": 3,
            "write-past-end": 4,
            "endless-loop": 5,
            "stale-shared": 6,
        }[which]
        src = self.fenced(torch.arange(blocks * threads, dtype=torch.float32))
        out = self.fenced(torch.zeros(blocks * threads, dtype=torch.float32))
        rc = self.lib.fgd_emu_selftest(code, src.data_ptr(), out.data_ptr(), blocks, threads)
        return rc, self.lib.fgd_emu_last_message().decode(), out

    def convert(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """float32 → float16/bfloat16 or back with the emulator's __float2half_rn etc."""
        x = x.contiguous()
        half = {torch.float16: "half", torch.bfloat16: "bfloat16"}
        if x.dtype == torch.float32:
            out = torch.empty(x.shape, dtype=dtype)
            getattr(self.lib, f"fgd_emu_float_to_{half[dtype]}")(x.data_ptr(), out.data_ptr(), x.numel())
        else:
            out = torch.empty(x.shape, dtype=torch.float32)
            getattr(self.lib, f"fgd_emu_{half[x.dtype]}_to_float")(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    # ---- checks

    def _launch(self, what, fn, buffers, read_only, *args) -> None:
        self.lib.fgd_emu_clear_error()
        rc = fn(*args)
        if rc != 0:
            raise RuntimeError(
                f"fgd_fast CUDA extension (emulated): {what} failed: error {rc} "
                f"({self.lib.fgd_emu_last_message().decode()})"
            )
        if not all(guards_intact(b) for b in buffers):
            raise RuntimeError(f"emulator: the {what} wrote before the start of a buffer")
        for copy, original in read_only:
            if not torch.equal(copy.view(_INT[copy.element_size()]), original.view(_INT[original.element_size()])):
                raise RuntimeError(f"emulator: the {what} wrote into a read-only table")

    def _check_meta(self, meta) -> None:
        if not (
            meta.device.type == "cpu"
            and meta.dtype == torch.int64
            and meta.dim() == 2
            and meta.shape[1] == self._k["META_FIELDS"]
            and meta.is_contiguous()
        ):
            raise RuntimeError(
                f"meta must be a contiguous CPU int64 tensor of shape "
                f"(layers, {self._k['META_FIELDS']}), "
                f"got {tuple(meta.shape)} {meta.dtype} on {meta.device}"
            )

    def _check_acc(self, t, dtype, numel, name) -> None:
        if dtype not in self._acc:
            raise RuntimeError(f"unknown dtype code {dtype}")
        if not (t.device.type == "cpu" and t.dtype == self._acc[dtype] and t.is_contiguous() and t.numel() >= numel):
            raise RuntimeError(
                f"{name} must be a contiguous {self._acc[dtype]} CPU tensor of at least {numel} "
                f"elements, got {t.numel()} {t.dtype} on {t.device}"
            )


def _require_cpu(params) -> None:
    bad = {str(p.device) for p in params if p.device.type != "cpu"}
    if bad:
        raise RuntimeError(f"the emulated CUDA kernels dereference host pointers: CPU tensors only, got {bad}")


def load_backend(ext: EmulatedExtension, sm_count: int = 1) -> ModuleType:
    """A private instance of ``fgd_fast/backends/cuda.py`` (not in ``sys.modules``, so the real
    module and every other test are untouched) whose extension is ``ext``: the file's own code
    runs unchanged (tables, splits, middle, launches), with its loader
    ``fgd_fast._cuda_build.load`` patched for the import only, its device check replaced by a
    CPU check and the GPU's SM count (which sizes splits and the update grid) set to
    ``sm_count``; tests may monkeypatch ``force_splits`` and ``_sm_count`` on it."""
    import fgd_fast.backends
    from fgd_fast import _cuda_build

    path = Path(fgd_fast.backends.__file__).resolve().parent / "cuda.py"
    spec = importlib.util.spec_from_file_location("fgd_fast.backends._cuda_emulated", path)
    module = importlib.util.module_from_spec(spec)
    real_load = _cuda_build.load
    _cuda_build.load = lambda: ext
    try:
        spec.loader.exec_module(module)
    finally:
        _cuda_build.load = real_load
    for name in ("needs_cuda", "_sm_count", "force_splits", "_ext"):  # what the tests rely on
        assert hasattr(module, name), f"fgd_fast/backends/cuda.py has no {name}: update tests/cuda_emulation"
    assert module._ext is ext
    module.needs_cuda = lambda backend, params, allow=False: _require_cpu(params)
    module._sm_count = lambda device: sm_count
    return module
