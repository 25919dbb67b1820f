"""Triton backend: the whole step for every orthogonal layer in a handful of launches.

Layers are split into *launch classes* by (parameter dtype, Φ present, memory layout); a
class is usually everything. Per class and step:

1. ``gram_kernel``, one launch per Gram block (A, E; plus B, C when Φ is stored) covering
   every layer, split over n when there are too few tiles to fill the GPU; the splits are
   summed by one ``torch.sum`` in a fixed order, so the result is deterministic run to run.
2. The O(p³) middle (:mod:`.algebra`) with batched torch ops on the ``p × p`` blocks, one
   batch per distinct p (never per layer), writing ``[M_Φ | M]`` for every layer, the
   distance ``‖A − I‖_F`` and the finite flag (E = θᵀg is NaN/Inf whenever g is: the
   check is fused into the Gram pass, no extra pass over g).
3. ``update_kernel`` (in ``apply``): ``Φ₊ = U + θM_Φ`` (when Φ is stored), then
   ``θ₊ = θ + V + θM`` with ``(V, M) = (Φ₊, −α(A − I))``, or ``(−ηg, M_θ)`` without Φ.

So a step costs at most 6 kernel launches per class plus O(#distinct p) small torch ops,
independent of the number of layers (``launch_counts`` records kernel launches, for tests).

Metadata: an int64 table (pointers, n, p, offsets; see ``fgd_fast.kernels.fgd_step``) and
int32 work tables. Work tables depend only on shapes and are cached; the pointer table is
cached on the tuple of addresses, so a step whose tensors did not move (CUDA-graph replay,
steady training) copies nothing to the device and never synchronises with the host.

Scratch, bounded: Gram partials ``splits × Σ 4p²`` (only when splitting, capped at
``SCRATCH_BYTES``) and the update snapshot ``programs × BR × p_max`` (programs capped so it
stays under ``SCRATCH_BYTES``; BR = 32 rows for float32), besides the Gram blocks
``Σ 4p²`` and M matrices ``Σ 2p²`` the algorithm needs. For WRN-28-10 ("official", Σp² =
3.76e6) on an H100 (132 SMs): 60 MB of Gram blocks, 30 MB of M, no split partials (532
symmetric tiles already fill the GPU) and 22 MB of snapshot (264 programs × 32 × 640 fp32),
next to 135 MB of constrained parameters; parameters whose memory is not a dense ``(c_o, m)`` matrix
(e.g. channels_last convolution weights) are staged through a contiguous copy.

Precision (``precision=``): ``"ieee"`` (default, fp32 FMA), ``"tf32x3"`` (3×TF32 on tensor
cores, close to fp32), ``"tf32"`` (opt-in: ~1e-3 relative error in A, so θ settles ~1e-3
off the manifold). float64 layers always compute in float64 ("ieee").
"""
from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fgd_fast.kernels import fgd_step as K

from .._matrix import stiefel_shape
from .algebra import middle
from .base import PRECISIONS, TableCache, compute_dtype, device_table, full_precision, plan_of

__all__ = ["prepare_triton", "launch_counts", "PRECISIONS", "SCRATCH_BYTES"]

SCRATCH_BYTES = 64 << 20
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}

#: kernel name -> number of launches since import (tests assert the launch count per step)
launch_counts: Counter = Counter()
#: tests may force a number of n-splits for the Gram pass (None: chosen from the GPU size)
force_splits: int | None = None


def _launch(kernel, grid, *args, **kwargs) -> None:
    launch_counts[kernel.fn.__name__] += 1
    kernel[grid](*args, **kwargs)


def _programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another


_tables = TableCache()


@dataclass
class _Shapes:
    """Everything about a launch class that depends only on the layer shapes."""

    gram_sym: torch.Tensor  # int32 (W, 3): layer, tile i, tile j, i <= j (A and C)
    gram_full: torch.Tensor  # int32 (W, 3): every (layer, i, j) (B and E)
    update_work: torch.Tensor  # int32 (I, 2): layer, row block
    gram_off: list[int]  # element offset of [A|B|C|E] per layer
    m_off: list[int]  # element offset of [M_θ|M_Φ] per layer
    chunk: list[int]  # rows per split per layer
    splits: int
    gram_total: int
    m_total: int
    p_runs: list[tuple[int, int, int]]  # (p, first layer, last layer + 1), layers sorted by p


def _shapes(np_list, device, wanted, bp, bk, br, acc_name) -> _Shapes:
    acc_bytes = 8 if acc_name == "float64" else 4
    gram_sym, gram_full, update_work, gram_off, m_off = [], [], [], [], []
    g_total = m_total = 0
    for layer, (n, p) in enumerate(np_list):
        nt = triton.cdiv(p, bp)
        gram_sym += [(layer, i, j) for i in range(nt) for j in range(i, nt)]
        gram_full += [(layer, i, j) for i in range(nt) for j in range(nt)]
        update_work += [(layer, r) for r in range(triton.cdiv(n, br))]
        gram_off.append(g_total)
        m_off.append(m_total)
        g_total += 4 * p * p
        m_total += 2 * p * p
    splits = force_splits or max(1, min(64, triton.cdiv(wanted, len(gram_sym))))
    splits = max(1, min(splits, SCRATCH_BYTES // max(1, g_total * acc_bytes)))
    chunk = [triton.cdiv(triton.cdiv(n, splits), bk) * bk for n, _ in np_list]
    runs, start = [], 0
    for layer in range(1, len(np_list) + 1):
        if layer == len(np_list) or np_list[layer][1] != np_list[start][1]:
            runs.append((np_list[start][1], start, layer))
            start = layer
    as_table = lambda rows, width: device_table(rows, torch.int32, device).reshape(-1, width)  # noqa: E731
    return _Shapes(
        as_table(gram_sym, 3), as_table(gram_full, 3), as_table(update_work, 2),
        gram_off, m_off, chunk, splits, g_total, m_total, runs,
    )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A dense ``(c_o, m)`` tensor sharing memory with ``t``, or a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


class _Class:
    """One launch class: its tables, Gram pass and middle (prepare) and update (apply)."""

    def __init__(self, layers, params, grads, bufs, lr, beta, alpha, dtype, has_phi, rows, precision):
        device = params[layers[0]].device
        self.acc = compute_dtype(dtype)
        self.has_phi = has_phi
        acc_name = str(self.acc).removeprefix("torch.")
        precision = "ieee" if self.acc == torch.float64 else precision
        self.consts = dict(DTYPE=_TL[dtype], ACC=_TL[self.acc], ROWS=rows, PRECISION=precision)
        dtype_name = str(dtype).removeprefix("torch.")
        self.gram_config = K.kernel_config(K.GRAM_CONFIG, dtype_name, precision)
        self.update_config = K.kernel_config(K.UPDATE_CONFIG, dtype_name, precision)
        layers = sorted(layers, key=lambda i: stiefel_shape(params[i].shape).p)  # group equal p
        self.layers = layers
        np_list = [stiefel_shape(params[i].shape)[:2] for i in layers]
        blocking = (self.gram_config["BP"], self.gram_config["BK"], self.update_config["BR"], acc_name)
        self.shapes = _tables.get_or(
            ("shapes", device, tuple(np_list), _programs_wanted(device), blocking, force_splits),
            lambda: _shapes(np_list, device, _programs_wanted(device), *blocking),
        )
        sh = self.shapes
        # tensors the kernels address: dense (c_o, m) memory; copies are written back in apply
        self.theta = [_dense(params[i]) for i in layers]
        self.grad = [_dense(grads[i]) for i in layers]
        self.phi = [_dense(bufs[i]) for i in layers] if has_phi else []
        self.copy_back = [(params[i], t) for i, t in zip(layers, self.theta) if t is not params[i]]
        self.copy_back += [(bufs[i], t) for i, t in zip(layers, self.phi) if t is not bufs[i]]
        ptrs = tuple(
            (t.data_ptr(), self.phi[k].data_ptr() if has_phi else 0, self.grad[k].data_ptr())
            for k, t in enumerate(self.theta)
        )
        self.meta = _tables.get_or(("meta", device, ptrs, tuple(np_list), sh.splits), lambda: device_table(
            [[*pt, n, p, sh.gram_off[k], sh.m_off[k], sh.chunk[k]] for k, (pt, (n, p)) in enumerate(zip(ptrs, np_list))],
            torch.int64, device,
        ))
        hyper_values = tuple((lr[i], beta[i], alpha[i]) for i in layers)
        self.hyper = _tables.get_or(
            ("hyper", device, hyper_values, self.acc), lambda: device_table(hyper_values, self.acc, device)
        )  # (L, 3): η, β, α

        # pass 1: Gram blocks, split over n, then a fixed-order sum of the splits
        partial = torch.empty(sh.splits * sh.gram_total, dtype=self.acc, device=device)
        blocks = (K.BLOCK_A, K.BLOCK_B, K.BLOCK_C, K.BLOCK_E) if has_phi else (K.BLOCK_A, K.BLOCK_E)
        for block in blocks:
            work = sh.gram_sym if block in (K.BLOCK_A, K.BLOCK_C) else sh.gram_full
            _launch(
                K.gram_kernel, (work.shape[0], sh.splits),
                self.meta, work, partial, sh.gram_total, BLOCK=block, **self.consts, **self.gram_config,
            )
        gram = partial.view(sh.splits, sh.gram_total).sum(0) if sh.splits > 1 else partial

        # the O(p³) middle, one batch per distinct p
        # (IEEE fp32 products whatever the global TF32 setting)
        self.mats = torch.empty(sh.m_total, dtype=self.acc, device=device)
        dists, finites = [], []
        with full_precision():
            for p, lo, hi in sh.p_runs:
                blocks = gram[sh.gram_off[lo]:sh.gram_off[lo] + (hi - lo) * 4 * p * p].view(hi - lo, 4, p, p)
                h = self.hyper[lo:hi].view(hi - lo, 3, 1, 1)
                mid = middle(
                    blocks[:, 0], blocks[:, 1] if has_phi else None, blocks[:, 2] if has_phi else None, blocks[:, 3],
                    lr=h[:, 0], beta=h[:, 1], alpha=h[:, 2],
                )
                out = self.mats[sh.m_off[lo]:sh.m_off[lo] + (hi - lo) * 2 * p * p].view(hi - lo, 2, p, p)
                if has_phi:
                    out[:, 0].copy_(mid.m_phi)  # Φ₊ = U + θ M_Φ
                    out[:, 1].copy_(mid.feedback)  # θ₊ = θ + Φ₊ + θ(−α(A − I))
                else:
                    out[:, 1].copy_(mid.m_theta)  # θ₊ = θ − ηg + θ M_θ
                dists.append(mid.dist)
                finites.append(mid.finite)
        self.dist = torch.cat(dists).to(torch.float64)
        self.finite = torch.cat(finites)
        self.p_max = max(p for p, _, _ in sh.p_runs)
        self.device = device

        # the update's scratch is reserved here too, so that apply() allocates nothing: a step
        # that fails for lack of memory fails before any write.
        # persistent grid: ~2 programs per SM (on an H200, 1, 2, 4 or 8 per SM timed within
        # 3% of each other: benchmarks/results/gpu-h200-2026-11-26-triton-probe.md)
        br = self.update_config["BR"]
        acc_bytes = torch.finfo(self.acc).bits // 8
        programs = _programs_wanted(device) // 2 if device.type == "cuda" else 2
        programs = max(1, min(programs, sh.update_work.shape[0], SCRATCH_BYTES // (br * self.p_max * acc_bytes)))
        self.programs = programs
        self.scratch = torch.empty(programs * br * self.p_max, dtype=self.acc, device=device)

    def apply(self) -> None:
        sh = self.shapes
        args = (self.meta, self.hyper, sh.update_work, sh.update_work.shape[0], self.mats, self.scratch, self.p_max)
        modes = (K.MODE_PHI, K.MODE_THETA) if self.has_phi else (K.MODE_THETA,)
        for mode in modes:  # Φ₊ first: the θ pass reads it
            _launch(K.update_kernel, (self.programs,), *args, MODE=mode, HAS_PHI=self.has_phi, **self.consts, **self.update_config)
        for dst, src in self.copy_back:
            dst.copy_(src)


def prepare_triton(params, grads, bufs, fresh, *, lr, momentum, feedback, check_finite, precision="ieee"):
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision={precision!r}: choose one of {', '.join(map(repr, PRECISIONS))}")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and any(p.device.type != "cuda" for p in params):
        raise RuntimeError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU testing)")
    classes: dict[tuple, list[int]] = defaultdict(list)
    for i, param in enumerate(params):
        classes[(param.dtype, bufs[i] is not None, stiefel_shape(param.shape).transposed)].append(i)
    built = [
        _Class(idx, params, grads, bufs, lr, momentum, feedback, dtype, has_phi, rows, precision)
        for (dtype, has_phi, rows), idx in classes.items()
    ]
    return plan_of(built, params[0].device if params else torch.device("cpu"), check_finite)
