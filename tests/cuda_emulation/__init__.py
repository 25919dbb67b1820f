"""CPU emulation of the fgd_fast CUDA kernels (``csrc/*.cu``), for CI machines without a GPU.

How: :mod:`.build` copies the real ``.cu`` sources, rewrites each ``k<<<grid, block, …>>>(args)``
launch into a call of the emulator (:file:`emu.h`) and compiles them with g++ (C++20, -O2)
against stand-in CUDA headers (:file:`include/`) into a shared library, in a temporary folder,
once per test session (no binary is checked in). :class:`.stand_in.EmulatedExtension` is a
ctypes stand-in for the extension module ``fgd_fast._C`` (same functions and argument checks as
``csrc/fgd_binding.cpp``, on CPU tensors), and :func:`.stand_in.load_backend` executes the real
``fgd_fast/backends/cuda.py`` with it, so the whole ``prepare_cuda`` path — metadata tables,
layer order, split choice, partial buffers, the batched O(p³) middle, hyper-parameter table,
update grid, staging copies for channels_last — runs unchanged; only the extension is swapped,
and only in a private module instance (``sys.modules`` and the real module are untouched).

The emulator (:file:`emu.h`) runs a launch's blocks one after another and a block's threads
as fibers on one OS thread, each until its next ``__syncthreads()``; ``__shared__`` becomes a
static shared by the running block. tests/test_cuda_emulated.py compares the results with
the float64 NumPy oracle and the reference backend. Linux only (fibers, signals, mmap).

What it can show (on every CI run, in well under a minute on two cores):

* indexing and masking: tile decoding ([A△ | E | B | C△] per layer), the upper-triangle
  walk and mirrored stores, edge tiles (p = 65, 130; n not a multiple of a tile), strides
  of both layouts (θ = W2ᵀ and θ = W2), the binary search for a work item's layer, ragged
  layers in one launch, the split chunks (including empty splits), the persistent update
  grid striding over row blocks;
* reductions and arithmetic: the K loops, the fixed-order split sum, the update's epilogue
  (U = βΦ − ηg, θ₊, Φ₊, the Φ flags), fp32/fp64 accumulation, the float16/bfloat16 loads
  and round-to-nearest-even stores (emulated bit-exactly, checked against torch);
* ``__syncthreads()`` placement within a block: threads run in sequence, so a missing
  barrier makes a thread read shared memory its neighbours have not written yet (or that
  they already overwrote) and the result is wrong; a barrier reached by only some threads
  fails the launch; results must be bitwise equal when blocks and threads run in reverse
  order;
* out-of-bounds accesses, mostly: every buffer a kernel gets from the tests or the stand-in
  ends at an inaccessible page, so a read or write just past its end fails the launch with
  "illegal address" (kernel, block and thread named) instead of passing silently; a guard
  band before it catches writes before its start (reads there get NaN); outputs and scratch
  are NaN-filled first, so an element never written spreads NaN; the read-only tables must
  be unchanged; shared memory holds NaN where a block has not written it (fresh in each
  block, as a GPU's holds garbage), so a tile element read but never loaded (a dropped zero
  fill past an edge) spreads NaN even where it meets a zero. An endless loop fails the
  launch after a timeout (``FGD_EMU_LAUNCH_TIMEOUT``, default 60 s);
* determinism, that ``prepare`` writes nothing, the launch count, the binding's checks.

What it cannot show:

* anything about concurrency: blocks never run at the same time and threads never
  interleave except at barriers, so inter-block races, the memory model (visibility,
  ordering, fences), atomics and warp-level behaviour (shuffles, ``__syncwarp``, implicit
  warp synchrony) are untested. The kernels are race-free by design (each output element is
  written by exactly one thread of one block, no atomics); the reverse-order run is the
  only check of that here;
* accesses that land inside other valid memory: the staging copies cuda.py makes for
  channels_last tensors are ordinary allocations, and a wild index that lands inside any
  buffer is only caught through the wrong result it causes;
* resource limits and performance: registers, spills, shared memory size, occupancy,
  coalescing, launch bounds (the nvcc compile test in test_cuda_build.py covers
  compilation and spills; timings need a GPU);
* bitwise GPU numerics: nvcc contracts ``a*b + c`` into FMAs and g++ is told not to
  (``-ffp-contract=off``), so results agree with a GPU's to rounding, not bit for bit;
* the real binding (``fgd_binding.cpp``: streams, device guards, error translation) and
  the CUDA runtime: the stand-in reimplements the binding's checks in Python.
"""

from .build import build_library, compiler, poison_shared_arrays, rewrite_launches
from .stand_in import EmulatedExtension, guards_intact, load_backend

__all__ = [
    "build_library",
    "compiler",
    "poison_shared_arrays",
    "rewrite_launches",
    "EmulatedExtension",
    "guards_intact",
    "load_backend",
]
