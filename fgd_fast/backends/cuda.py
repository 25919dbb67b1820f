"""CUDA backend: the two-pass FGD step (docs/algorithm.md §3) with the C++/CUDA extension
(``csrc/``). Same arithmetic as :mod:`.torch_batched`; IEEE fp32 FMA (fp64 for float64
parameters) everywhere (the optimizer refuses ``precision`` other than ``"ieee"`` for it).

What it is for: a small step memory on convolution layer sets with no Triton needed (the
measured memory and time against the other backends are in the README's GPU section and
``benchmarks/results/``). ``"auto"`` never picks it: ask for ``backend="cuda"``.

Per step and *launch class* (one per parameter dtype; usually one in all):

1. ``fgd_gram_kernel`` (prepare, one launch): the Gram blocks ``A = θᵀθ``, ``E = θᵀg`` and,
   for layers that read Φ, ``B = θᵀΦ``, ``C = ΦᵀΦ`` of every layer. Grid
   ``(total tiles, splits)``, 256 threads; each block computes one 64 × 64 output tile
   ``XᵀY`` (16 × 16 threads × 4 × 4 outputs, K loop of 32 rows through shared memory)
   over one split of n. Per layer the tiles are ``[A upper triangle | E | B | C upper
   triangle]``: the symmetric A and C are computed once per tile pair ``i ≤ j`` and mirrored
   on store. Split ``s`` writes its own slab of a partials buffer (no atomics), and
   ``fgd_sum_splits_kernel`` adds the slabs in the fixed order s = 0, 1, … (one more launch,
   only when splits > 1): bitwise reproducible run to run.
2. The O(p³) middle (:func:`.algebra.middle`) with batched torch ops on the ``p × p`` blocks,
   one batch per distinct (p, reads Φ), never per layer: ``M_θ``, ``M_Φ``, the distance
   ``‖A − I‖_F`` and the finite flag (E = θᵀg is NaN/Inf whenever g is: no extra pass).
3. ``fgd_update_kernel`` (apply, one launch): ``U = βΦ − ηg``, ``θ₊ = θ + U + θ M_θ``,
   ``Φ₊ = U + θ M_Φ`` (first step: Φ not read; momentum 0: Φ not stored). A persistent grid
   strides over *row blocks* of 32 rows; the block owning a row block snapshots
   ``θ[rows, :]`` into its slice of a scratch buffer, then computes every 32 × 64 output tile
   from the snapshot and writes θ₊ and Φ₊ in place. No other block touches those rows, so
   the in-place write of θ is race-free.

So a step is 2–3 kernel launches per class plus a few small torch ops per distinct p,
independent of the number of layers (``launch_counts`` records launches, for tests).

Metadata: an int64 table ``(layers, META_FIELDS)`` whose columns are named in
``csrc/fgd_cuda.h`` (and exported by the extension's ``constants()``, which this module
reads): the addresses of θ, Φ (0 when absent) and g; n, p; the row/column strides of each
as an ``n × p`` matrix (so both layouts, ``θ = W2ᵀ`` with unit row stride and ``θ = W2``
with unit column stride, are read in place); flags (reads Φ, writes Φ); the offsets of the
layer's Gram blocks and ``[M_θ | M_Φ]``; its first Gram tile and first update row block
(prefix sums: a block finds its layer by binary search); the rows per Gram split. Plus a
``(layers, 3)`` table of η, β, α in the accumulation type. Tables are cached on their
contents, so a step whose tensors did not move copies nothing to the device. All index
arithmetic in the kernels is 64-bit.

Scratch, bounded by ``SCRATCH_BYTES`` (64 MiB): Gram partials ``splits × Σ k·p²`` (k = 4
with Φ, else 2; splits ≤ 64 and capped by the bound) and the update snapshot
``grid × 32 × p_max`` accumulation-type elements (grid capped by the bound, at least one
block: 32 · p_max · 8 bytes). Parameters, buffers or gradients whose memory is not a dense
``(c_o, m)`` matrix or its transpose (e.g. channels_last convolution weights) are staged
through a contiguous copy, written back in ``apply``.

Errors: every launch's ``cudaGetLastError`` is raised as ``RuntimeError`` by the binding;
``FGD_FAST_CUDA_DEBUG=1`` also synchronises after each launch so an asynchronous fault is
reported at the kernel that caused it.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from .._cuda_build import load as _load_extension
from .._matrix import stiefel_shape
from .algebra import grad_sq, scaled_hyper
from .base import (
    M_PHI,
    M_THETA,
    SLOT_A,
    SLOT_B,
    SLOT_C,
    SLOT_E,
    TableCache,
    check_precision,
    compute_dtype,
    device_of,
    device_table,
    hyper_table,
    layer_classes,
    middle_of_runs,
    needs_cuda,
    phase,
    plan_of,
    runs_of,
)
from .guard_rule import store_unit

__all__ = ["prepare_cuda", "launch_counts", "SCRATCH_BYTES"]

_ext = _load_extension()  # ImportError (→ BackendUnavailable) with the reason if unavailable
_K = _ext.constants()
if _K["SLOTS"] != dict(A=SLOT_A, E=SLOT_E, B=SLOT_B, C=SLOT_C, M_THETA=M_THETA, M_PHI=M_PHI):
    raise ImportError(f"the CUDA extension's block order {_K['SLOTS']} is not the backends' (rebuild fgd_fast._C)")
_F = _K["FIELDS"]  # column of each metadata field
_TILE, _BK, _ROWS = _K["GRAM_TILE"], _K["GRAM_BK"], _K["UPD_ROWS"]
_CODE = {torch.float32: _K["F32"], torch.float16: _K["F16"], torch.bfloat16: _K["BF16"], torch.float64: _K["F64"]}

SCRATCH_BYTES = 64 << 20
#: kernel name -> launches since import (tests check the launch count per step)
launch_counts: Counter = Counter()
#: tests may force the number of n-splits of the Gram pass (None: chosen from the GPU size)
force_splits: int | None = None
_DEBUG_SYNC = os.environ.get("FGD_FAST_CUDA_DEBUG", "0") not in ("", "0")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(name: str, fn, *args) -> None:
    launch_counts[name] += 1
    fn(*args)
    if _DEBUG_SYNC:  # surface an asynchronous kernel error at the launch that caused it
        _ext.synchronize(args[0])


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_tables = TableCache()


def _operand(t: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, int, int]:
    """``(w, sr, sc)``: θ[r, c] of ``t`` is at ``w.data_ptr()`` + ``r·sr + c·sc`` elements.

    ``w`` is ``t``'s ``(c_o, m)`` view when that is dense (row-major or its transpose), else a
    contiguous copy (the caller writes a copy back)."""
    w = None
    try:
        w = t.view(t.shape[0], -1)
    except RuntimeError:
        pass
    if w is None or not (w.is_contiguous() or w.t().is_contiguous()):
        w = t.contiguous().view(t.shape[0], -1)
    s0, s1 = w.stride()
    return (w, s1, s0) if transposed else (w, s0, s1)


class _Class:
    """The layers of one dtype: tables, Gram pass and middle (prepare); update (apply)."""

    def __init__(
        self,
        idx,
        params,
        grads,
        bufs,
        fresh,
        lr,
        beta,
        alpha,
        dtype,
        trust_radius=None,
        max_distance=None,
        variant="official",
    ):
        device = params[idx[0]].device
        self.device, self.code, self.acc = device, _CODE[dtype], compute_dtype(dtype)
        acc_bytes = torch.finfo(self.acc).bits // 8
        # layer order: by (reads Φ, p), so each batch of the middle is one contiguous run
        order = sorted(idx, key=lambda i: (bufs[i] is not None and not fresh[i], stiefel_shape(params[i].shape).p))
        self.layers = order
        self.keep, self.copy_back, rows = [], [], []
        gram_off = m_off = tile = block = 0
        shapes: list[tuple[int, bool]] = []  # (p, reads Φ) per layer, for the runs of the middle
        for i in order:
            n, p, transposed = stiefel_shape(params[i].shape)
            reads, writes = bufs[i] is not None and not fresh[i], bufs[i] is not None
            theta, tsr, tsc = _operand(params[i], transposed)
            g = grads[i] if grads[i].dtype == dtype else grads[i].to(dtype)
            grad, gsr, gsc = _operand(g, transposed)
            phi, psr, psc = _operand(bufs[i], transposed) if writes else (None, 0, 0)
            if theta.data_ptr() != params[i].data_ptr():
                self.copy_back.append((params[i], theta))
            if writes and phi.data_ptr() != bufs[i].data_ptr():
                self.copy_back.append((bufs[i], phi))
            self.keep += [theta, grad] + ([phi] if writes else [])
            row = [0] * _K["META_FIELDS"]
            row[_F["THETA"]], row[_F["GRAD"]] = theta.data_ptr(), grad.data_ptr()
            row[_F["PHI"]] = phi.data_ptr() if writes else 0
            row[_F["N"]], row[_F["P"]] = n, p
            row[_F["THETA_SR"]], row[_F["THETA_SC"]] = tsr, tsc
            row[_F["PHI_SR"]], row[_F["PHI_SC"]] = psr, psc
            row[_F["GRAD_SR"]], row[_F["GRAD_SC"]] = gsr, gsc
            row[_F["FLAGS"]] = (_K["READS_PHI"] if reads else 0) | (_K["WRITES_PHI"] if writes else 0)
            row[_F["GRAM_OFF"]], row[_F["M_OFF"]] = gram_off, m_off
            row[_F["FIRST_TILE"]], row[_F["FIRST_BLOCK"]] = tile, block
            rows.append(row)
            shapes.append((p, reads))
            nt = _cdiv(p, _TILE)
            tile += (nt * (nt + 1) // 2 + nt * nt) * (2 if reads else 1)  # [A△ | E] (+ [B | C△])
            block += _cdiv(n, _ROWS)
            gram_off += (4 if reads else 2) * p * p
            m_off += 2 * p * p
        runs = runs_of(shapes, [4 if reads else 2 for _, reads in shapes])  # [A | E] (+ [B | C])
        self.total_tiles, self.total_blocks = tile, block
        self.p_max = max(r[_F["P"]] for r in rows)

        # split n when there are too few tiles to fill the GPU; the partials stay under the bound
        n_max = max(r[_F["N"]] for r in rows)
        splits = force_splits or max(1, min(64, _cdiv(4 * _sm_count(device), tile), _cdiv(n_max, _BK)))
        splits = max(1, min(splits, SCRATCH_BYTES // (gram_off * acc_bytes)))
        for r in rows:
            r[_F["CHUNK"]] = _cdiv(_cdiv(r[_F["N"]], splits), _BK) * _BK
        self.meta = _tables.get_or(
            ("meta", device, tuple(map(tuple, rows))),
            lambda: device_table(rows, torch.int64, device),
        )
        hyper = tuple((lr[i], beta[i], alpha[i]) for i in order)
        self.hyper = hyper_table(hyper, self.acc, device, tuple(params[i].data_ptr() for i in order))

        # pass 1: Gram blocks of every layer, then the fixed-order sum of the splits
        with phase("gram"):
            partial = torch.empty(splits * gram_off, dtype=self.acc, device=device)
            _launch("gram", _ext.gram, self.meta, partial, gram_off, tile, splits, self.code)
            gram = partial
            if splits > 1:
                gram = torch.empty(gram_off, dtype=self.acc, device=device)
                _launch("sum_splits", _ext.sum_splits, partial, gram, gram_off, splits)

        # the O(p³) middle, one batch per run of equal (reads Φ, p): [M_θ | M_Φ] per layer
        self.mats = torch.empty(m_off, dtype=self.acc, device=device)
        # the guard's ‖g‖² by one multi-tensor torch op on the inputs (the Gram kernel does not take it)
        predict = trust_radius is not None or max_distance is not None
        with phase("middle"):
            g_sq = grad_sq([grads[i] for i in order]) if predict else None
            checks = middle_of_runs(
                gram,
                self.mats,
                self.hyper,
                runs,
                g_sq=g_sq,
                grads=[grads[i] for i in order],
                phis=[bufs[i] for i in order],
                unit=store_unit(params[order[0]].dtype),
                stored=params[order[0]].dtype,
                trust_radius=trust_radius,
                max_distance=max_distance,
                variant=variant,
            )
        self.dist, self.finite = checks.dist, checks.finite
        self.dist_next, self.finite_next, self.guarded = checks.dist_next, checks.finite_next, checks.guarded
        self.hyper_step = scaled_hyper(self.hyper, checks.scale)  # [sη, sβ, α]: the guard's U → sU
        # the update's scratch is reserved here, so that apply() allocates nothing: a step that
        # fails for lack of memory fails before any write
        acc_bytes = torch.finfo(self.acc).bits // 8
        grid = min(self.total_blocks, 4 * _sm_count(device), SCRATCH_BYTES // (_ROWS * self.p_max * acc_bytes))
        self.grid = max(1, grid)
        self.scratch = torch.empty(self.grid * _ROWS * self.p_max, dtype=self.acc, device=device)

    def apply(self) -> None:
        with phase("update"):
            self._update()

    def _update(self) -> None:
        _launch(
            "update",
            _ext.update,
            self.meta,
            self.hyper_step,
            self.mats,
            self.scratch,
            self.total_blocks,
            self.grid,
            self.p_max,
            self.code,
        )
        for dst, src in self.copy_back:
            dst.copy_(src.view(dst.shape))  # staged copies are contiguous (c_o, m)


def prepare_cuda(
    params,
    grads,
    bufs,
    fresh,
    *,
    lr,
    momentum,
    feedback,
    check_finite,
    precision="ieee",
    trust_radius=None,
    max_distance=None,
    variant="official",
):
    check_precision(precision)
    needs_cuda("cuda", params)
    for param in params:
        if param.dtype not in _CODE:
            raise TypeError(
                f"backend='cuda' supports float16/bfloat16/float32/float64 parameters, got {param.dtype}; "
                "cast the parameter or use backend='torch'"
            )
    classes = layer_classes(len(params), lambda i: params[i].dtype)
    built = [
        _Class(idx, params, grads, bufs, fresh, lr, momentum, feedback, dtype, trust_radius, max_distance, variant)
        for dtype, idx in classes.items()
    ]
    return plan_of(built, device_of(params), check_finite, written=(params, bufs))  # (written in place)


prepare_cuda.device_lr = True  # takes lr as tensors (read on the device: base.hyper_table)
