"""Triton backend: the whole step for every orthogonal layer in a constant number of launches.

Layers are split into *launch classes* by (parameter dtype, Φ present, memory layout); a
class is usually everything. A step per class is either of two kernel sets, both writing the
fused backends' block order ``[A | E | B | C]`` and ``[M_θ | M_Φ]`` (:mod:`.base`):

**Tensor cores** (float32 parameters with ``precision="tf32x3"`` or ``"tf32"``;
:mod:`fgd_fast.kernels.tc_step`), three launches:

1. ``tc_split_kernel``: hi = tf32(θ) (and lo = tf32(θ − hi) for ``"tf32x3"``) into scratch.
2. ``tc_gram_kernel``: one TF32 GEMM pass, hiᵀ[hi | lo | Φ | g] plus ΦᵀΦ, persistent over the
   tiles of every layer (longest first), split over n when tiles are few; A = H + L + Lᵀ
   (3×TF32 for A alone: it sets the distance to the manifold), B, C, E in single TF32.
3. (``apply``) ``tc_update_kernel``: Φ₊ and θ₊ in one pass from hi, in place, no snapshot.

**CUDA cores** (``"ieee"``, 16-bit and float64 parameters; :mod:`fgd_fast.kernels.fgd_step`):

1. ``gram_kernel``, one launch per Gram block (A, E; plus B, C when Φ is stored).
2. (``apply``) ``update_kernel``: ``Φ₊ = U + θM_Φ`` (when Φ is stored), then
   ``θ₊ = θ + V + θM`` with ``(V, M) = (Φ₊, −α(A − I))``, or ``(−ηg, M_θ)`` without Φ.

Between the passes, the O(p³) middle writes the M matrices, the distance ``‖A − I‖_F`` and the
finite flag (E = θᵀg is NaN/Inf whenever g is: no extra pass over g). With float32 blocks
(every class but float64 parameters), the official update and a prediction (the guard or a
check on: the defaults) it is fused (:mod:`.fused_middle`): the Gram blocks gathered into the
middle's layout by one launch (:mod:`.gram_gather`), a prologue, five product launches and the
guard's three, so the tensor-core step is 13 launches per class and a handful of torch ops
(``tests/test_op_count.py``); otherwise
:func:`.base.middle_of_runs` runs :func:`.algebra.middle` with batched torch ops at the step's
precision, one batch per distinct p (never per layer), its products one launch each for every p
(:mod:`.mid_products`) and the guard's blend in three (:mod:`.guard_blend`). Split-K partials are
summed in a fixed order: deterministic run to run. The launch count is independent of the
number of layers (``launch_counts`` records kernel launches, for tests).

Metadata: an int64 table (fields named in :mod:`fgd_fast.kernels.meta`) and int32 work
tables. Work tables depend only on shapes and are cached; the pointer table is cached on the
tuple of addresses, so a step whose tensors did not move (CUDA-graph replay, steady training)
copies nothing to the device and never synchronises with the host.

Scratch, bounded: Gram partials ``splits × Σ slots·p²`` (only when splitting, capped at
``SCRATCH_BYTES``), for the CUDA-core update the snapshot ``programs × BR × p_max``, for the
tensor-core step hi and lo (``2 × Σ p·ld`` floats, ld = n rounded up to 128), besides the Gram
blocks and M matrices ``Σ 2p²`` the algorithm needs. For WRN-28-10 ("official", Σp² = 3.76e6):
60 MB of Gram blocks (75 MB with L), 30 MB of M; the tensor-core step adds 270 MB of hi/lo
next to 135 MB of constrained parameters, kept from step to step (one buffer per set of
parameters, the last few kept), because the metadata table holds its address: a steady or
captured step rebuilds nothing. Parameters whose memory is not a dense ``(c_o, m)``
matrix (e.g. channels_last convolution weights) are staged through a contiguous copy.

Precision (``precision=``): ``"tf32x3"`` (default; tensor cores; A in 3×TF32 with every
K-step's product added to the fp32 sum by a rounded add, the rest in TF32: fp32-level in the
distance θ settles at), ``"ieee"`` (fp32 FMA), ``"tf32"`` (opt-in:
~1e-3 relative error in A, so θ settles ~1e-3 off the manifold). float64 layers always compute
in float64 ("ieee"); 16-bit parameters use the CUDA-core kernels with tensor-core products.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

from fgd_fast.kernels import fgd_step as K
from fgd_fast.kernels import meta
from fgd_fast.kernels import tc_step as TC

from .._matrix import stiefel_shape
from . import fused_middle, gram_gather, guard_blend, mid_products, triton_launch
from . import triton_tables as tables
from .algebra import grad_norm, grad_sq, scaled_hyper
from .base import (
    M_PHI,
    M_THETA,
    PRECISIONS,
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
from .layout import Layout
from .triton_launch import launch_counts  # (re-exported: tests read the counts here)

__all__ = ["prepare_triton", "launch_counts", "PRECISIONS", "SCRATCH_BYTES"]

SCRATCH_BYTES = tables.SCRATCH_BYTES

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}
assert (SLOT_A, SLOT_E, SLOT_B, SLOT_C, M_THETA, M_PHI) == (
    meta.SLOT_A,
    meta.SLOT_E,
    meta.SLOT_B,
    meta.SLOT_C,
    meta.M_THETA,
    meta.M_PHI,
), "the kernels and the backends share one block order"

#: tests may force a number of n-splits for the Gram pass (None: chosen from the GPU size)
force_splits: int | None = None


_tables = TableCache()
# the tensor-core split pass's hi/lo buffers (the size of θ, twice) and Gram slabs: few kept, so that models
# made and dropped in one process (a sweep) do not pin old ones
_split_buffers = TableCache(capacity=16)
_fused_buffers = TableCache(capacity=8)  # the fused middle's memory per launch class (fused_middle.buffers)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A dense ``(c_o, m)`` tensor sharing memory with ``t``, or a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


class _Operands:
    """The tensors a launch class addresses (dense ``(c_o, m)`` memory; copies are written
    back in ``apply``) and the per-layer hyper-parameter table ``(L, 3)``: η, β, α."""

    def __init__(self, layers, params, grads, bufs, lr, beta, alpha, has_phi, acc):
        device = params[layers[0]].device
        self.theta = [_dense(params[i]) for i in layers]
        self.grad = [_dense(grads[i]) for i in layers]
        self.phi = [_dense(bufs[i]) for i in layers] if has_phi else []
        self.copy_back = [(params[i], t) for i, t in zip(layers, self.theta) if t is not params[i]]
        self.copy_back += [(bufs[i], t) for i, t in zip(layers, self.phi) if t is not bufs[i]]
        self.ptrs = tuple(
            (t.data_ptr(), self.phi[k].data_ptr() if has_phi else 0, self.grad[k].data_ptr())
            for k, t in enumerate(self.theta)
        )
        hyper_values = tuple((lr[i], beta[i], alpha[i]) for i in layers)
        self.hyper = hyper_table(hyper_values, acc, device, tuple(params[i].data_ptr() for i in layers))

    def write_back(self) -> None:
        for dst, src in self.copy_back:
            dst.copy_(src)


def _order(layers, params):
    """Layers sorted by p (equal p adjacent: one batch of the middle each) and their (n, p)."""
    layers = sorted(layers, key=lambda i: stiefel_shape(params[i].shape).p)
    return layers, [stiefel_shape(params[i].shape)[:2] for i in layers]


def _guard(ops, trust_radius, max_distance, variant, fused: bool = False, precision: str = "ieee") -> dict:
    """The step guard's arguments of :func:`.base.middle_of_runs`: ‖g‖² of every layer by one
    multi-tensor torch op on the inputs (the Gram kernels do not take it; ``fused``: not here,
    the fused middle takes ‖g‖ itself); G and H come from the Gram pass (gathered with the other
    blocks); the blend, where the guard binds, runs as kernels (:mod:`.guard_blend`)."""
    predict = trust_radius is not None or max_distance is not None
    g_sq = grad_sq(ops.grad) if predict and not fused else None
    unit = store_unit(ops.theta[0].dtype, tf32_grams=precision == "tf32") if ops.theta else 0.0
    return dict(
        g_sq=g_sq,
        unit=unit,
        stored=ops.theta[0].dtype if ops.theta else None,
        trust_radius=trust_radius,
        max_distance=max_distance,
        variant=variant,
        blend_kernels=guard_blend.blend,  # the guard's blend in three launches, not ~90 torch ops
    )


def _gatherer(slabs, splits, has_phi, predict, **layout):
    """``gather(lay, chain, out=None)`` for :func:`.base.middle_of_runs`: the chain's Gram blocks
    summed over the splits into the layout, in one launch (:func:`.gram_gather.gather`)."""

    def gather(lay, chain, out=None):
        sources = tuple(
            r.gram_at + k * r.slots * r.p * r.p for r in chain for k in range(r.end - r.first)
        )  # each layer's blocks in a slab
        return gram_gather.gather(lay, sources, slabs, splits, has_phi=has_phi, predict=predict, out=out, **layout)

    return gather


class _Checked:
    """What a launch class keeps from its middle: the per-layer checks, the update kernel's
    hyper-parameter table with the guard's scale folded in, and the update matrices."""

    def middle(self, slabs, runs, **kwargs) -> None:
        """The middle of every run (:func:`.base.middle_of_runs`): its checks, and M_θ (or F) and
        M_Φ kept where it left them for the update kernels (one chain: every layer of a class
        reads Φ alike; contiguous, so the kernels index them)."""
        kept = []
        self.checks(middle_of_runs(slabs, None, self.ops.hyper, runs, kept=kept, **kwargs))
        self.m_theta, self.m_phi = (m.contiguous() for m in kept[0])

    def fused(self, gather, runs, guard: dict, precision: str, key: tuple, feedback: bool = False) -> None:
        """The guarded middle as the fused kernels (:mod:`.fused_middle`): the Gram blocks gathered
        into the class's buffer (kept per ``key``), then nine launches; its checks, M_θ, M_Φ and
        the update's hyper-parameter table kept as :meth:`middle` keeps them (``feedback``: F
        in M_θ's place, for the CUDA-core θ pass that reads Φ₊)."""
        lay = Layout([(r.end - r.first, r.p) for r in runs], self.ops.hyper.device)
        bufs = _fused_buffers.get_or((*key, lay.groups), lambda: fused_middle.buffers(lay, self.ops.hyper.dtype))
        gather(lay, runs, out=bufs.blocks)
        mid = fused_middle.run(
            lay,
            bufs,
            hyper=self.ops.hyper,
            g_norm=grad_norm(self.ops.grad),
            has_phi=self.has_phi,
            radius=guard["trust_radius"],
            limit=guard["max_distance"],
            unit=guard["unit"],
            stored=guard["stored"],
            precision=precision,
            feedback=feedback,
        )
        self.m_theta, self.m_phi, self.hyper_step = mid.m_theta, mid.m_phi, mid.hyper
        self.dist, self.finite = mid.dist, mid.finite
        self.dist_next, self.finite_next, self.guarded = mid.dist_next, mid.finite_next, mid.guarded
        self.check_table = mid.check_table  # (read by the optimizer in one .tolist(): base.plan_of)

    def apply(self) -> None:
        """Every write of the class's step (:meth:`_apply`: the update kernels)."""
        with phase("update"):
            self._apply()

    def checks(self, checks) -> None:
        self.dist, self.finite = checks.dist, checks.finite
        self.dist_next, self.finite_next, self.guarded = checks.dist_next, checks.finite_next, checks.guarded
        self.hyper_step = scaled_hyper(self.ops.hyper, checks.scale)  # [sη, sβ, α]: the guard's U → sU


class _Class(_Checked):
    """A launch class on CUDA cores: tables, Gram pass and middle (prepare), update (apply)."""

    def __init__(
        self,
        layers,
        params,
        grads,
        bufs,
        lr,
        beta,
        alpha,
        dtype,
        has_phi,
        rows,
        precision,
        trust_radius=None,
        max_distance=None,
        variant="official",
    ):
        device = params[layers[0]].device
        self.acc = compute_dtype(dtype)
        self.has_phi = has_phi
        acc_name = str(self.acc).removeprefix("torch.")
        precision = "ieee" if self.acc == torch.float64 else precision
        self.consts = dict(DTYPE=_TL[dtype], ACC=_TL[self.acc], ROWS=rows, PRECISION=precision)
        dtype_name = str(dtype).removeprefix("torch.")
        self.gram_config = K.kernel_config(K.GRAM_CONFIG, dtype_name, precision)
        self.update_config = K.kernel_config(K.UPDATE_CONFIG, dtype_name, precision)
        self.layers, np_list = _order(layers, params)
        blocking = (self.gram_config["BP"], self.gram_config["BK"], self.update_config["BR"], acc_name)
        self.shapes = _tables.get_or(
            ("shapes", device, tuple(np_list), triton_launch.programs_wanted(device), blocking, force_splits),
            lambda: tables.shapes(
                np_list, device, triton_launch.programs_wanted(device), *blocking, forced_splits=force_splits
            ),
        )
        sh = self.shapes
        self.ops = ops = _Operands(self.layers, params, grads, bufs, lr, beta, alpha, has_phi, self.acc)
        self.meta = _tables.get_or(
            ("meta", device, ops.ptrs, tuple(np_list), sh.splits),
            lambda: device_table(
                [
                    meta.meta_row(
                        THETA=th, PHI=ph, GRAD=g, N=n, P=p, GRAM=sh.gram_off[k], M=sh.m_off[k], CHUNK=sh.chunk[k]
                    )
                    for k, ((th, ph, g), (n, p)) in enumerate(zip(ops.ptrs, np_list))
                ],
                torch.int64,
                device,
            ),
        )

        # pass 1: Gram blocks, split over n, then a fixed-order sum of the splits (into slabs kept
        # per set of parameters: every entry the gather reads is written first)
        with phase("gram"):
            owners = tuple(params[i].data_ptr() for i in self.layers)
            size = sh.splits * sh.gram_total
            partial = _split_buffers.get_or(
                ("gram", device, owners, size, self.acc), lambda: torch.empty(size, dtype=self.acc, device=device)
            )
            blocks = (SLOT_A, SLOT_E, SLOT_B, SLOT_C) if has_phi else (SLOT_A, SLOT_E)
            if trust_radius is not None or max_distance is not None:  # the guard's G = gᵀg (and H = Φᵀg)
                blocks += (meta.SLOT_G, meta.SLOT_H) if has_phi else (meta.SLOT_G,)
            for block in blocks:
                work = sh.gram_sym if block in (SLOT_A, SLOT_C, meta.SLOT_G) else sh.gram_full
                triton_launch.launch(
                    K.gram_kernel,
                    (work.shape[0], sh.splits),
                    self.meta,
                    work,
                    partial,
                    sh.gram_total,
                    BLOCK=block,
                    **self.consts,
                    **self.gram_config,
                )
        predict = trust_radius is not None or max_distance is not None
        gather = _gatherer(partial, sh.splits, has_phi, predict, mirror=False)  # the splits summed, into the layout

        # the O(p³) middle, one batch per distinct p; with Φ the θ pass reads Φ₊ and F = −α(A − I)
        runs = runs_of([(p, has_phi) for _, p in np_list], [meta.GRAM_SLOTS] * len(np_list))
        # float32 blocks: the fused middle or the middle's product kernels; float64 blocks keep
        # torch's products (Triton 3.6 cannot compile a float64 dot)
        fused = fused_middle.applies(dtype=self.acc, variant=variant, max_distance=max_distance)
        guard = _guard(ops, trust_radius, max_distance, variant, fused=fused, precision=precision)
        with phase("middle"):
            if fused:  # the middle and the guard in nine launches (fused_middle.py); F where Φ is read
                self.fused(gather, runs, guard, precision, ("middle", device, owners, has_phi), feedback=has_phi)
            else:
                self.middle(
                    partial,
                    runs,
                    gather=gather,
                    products=mid_products.engine(precision) if self.acc == torch.float32 else None,
                    feedback_with_phi=True,
                    precision=precision,
                    **guard,
                )
        self.p_max = max(p for _, p in np_list)

        # the update's scratch is reserved here too, so that apply() allocates nothing: a step
        # that fails for lack of memory fails before any write.
        # persistent grid: ~2 programs per SM (on an H200, 1, 2, 4 or 8 per SM timed within
        # 3% of each other: benchmarks/results/gpu-h200-2026-11-26-triton-probe.md)
        br = self.update_config["BR"]
        acc_bytes = torch.finfo(self.acc).bits // 8
        programs = triton_launch.programs_wanted(device) // 2 if device.type == "cuda" else 2
        programs = max(1, min(programs, sh.update_work.shape[0], SCRATCH_BYTES // (br * self.p_max * acc_bytes)))
        self.programs = programs
        self.scratch = torch.empty(programs * br * self.p_max, dtype=self.acc, device=device)

    def _apply(self) -> None:
        sh = self.shapes
        args = (self.meta, self.hyper_step, sh.update_work, sh.update_work.shape[0])
        modes = (meta.MODE_PHI, meta.MODE_THETA) if self.has_phi else (meta.MODE_THETA,)
        for mode in modes:  # Φ₊ first: the θ pass reads it
            triton_launch.launch(
                K.update_kernel,
                (self.programs,),
                *args,
                self.m_phi if mode == meta.MODE_PHI else self.m_theta,
                self.scratch,
                self.p_max,
                MODE=mode,
                HAS_PHI=self.has_phi,
                **self.consts,
                **self.update_config,
            )
        self.ops.write_back()


class _TensorCoreClass(_Checked):
    """A float32 launch class on tensor cores: split, Gram pass and middle (prepare), update (apply)."""

    def __init__(
        self,
        layers,
        params,
        grads,
        bufs,
        lr,
        beta,
        alpha,
        has_phi,
        rows,
        precision,
        trust_radius=None,
        max_distance=None,
        variant="official",
    ):
        device = params[layers[0]].device
        self.has_phi, self.rows = has_phi, rows
        self.lo = precision == "tf32x3"
        self.layers, np_list = _order(layers, params)
        self.ops = ops = _Operands(self.layers, params, grads, bufs, lr, beta, alpha, has_phi, torch.float32)
        # hi (and lo) of every layer: scratch written by the split pass (ld = n rounded up, 16-byte aligned)
        ld = [tables.cdiv(n, TC.LD_ALIGN) * TC.LD_ALIGN for n, _ in np_list]
        split_total = sum(p * d for (_, p), d in zip(np_list, ld))
        # one buffer per set of parameters, kept from step to step: its address is in the metadata
        # table, so a steady step (and a captured one) reuses both and builds nothing
        numel = (2 if self.lo else 1) * split_total
        owners = tuple(params[i].data_ptr() for i in self.layers)  # the parameters' own addresses
        self.split = _split_buffers.get_or(
            ("tc-split", device, owners, numel), lambda: torch.empty(numel, dtype=torch.float32, device=device)
        )
        aligned = tables.aligned([*ops.theta, *ops.grad, *ops.phi, self.split], np_list)
        self.consts = dict(ROWS=rows, ALIGNED=aligned)
        self.gram_config = TC.GRAM_CONFIG[precision, aligned]
        self.update_config = TC.UPDATE_CONFIG[precision, aligned]
        tiling = (tuple(self.gram_config.items()), tuple(self.update_config.items()), tuple(TC.SPLIT_CONFIG.items()))
        predict = trust_radius is not None or max_distance is not None
        key = (
            "tc",
            device,
            tuple(np_list),
            triton_launch.programs_wanted(device),
            has_phi,
            precision,
            tiling,
            force_splits,
            predict,
        )
        self.shapes = sh = _tables.get_or(
            key,
            lambda: tables.tc_shapes(
                np_list,
                device,
                triton_launch.programs_wanted(device),
                has_phi,
                self.lo,
                self.gram_config,
                self.update_config,
                TC.SPLIT_CONFIG,
                predict,
                forced_splits=force_splits,
            ),
        )
        base = self.split.data_ptr()
        self.meta = _tables.get_or(
            ("tc-meta", device, ops.ptrs, base, key),
            lambda: device_table(
                [
                    meta.meta_row(
                        THETA=th,
                        PHI=ph,
                        GRAD=g,
                        N=n,
                        P=p,
                        LD=sh.ld[k],
                        GRAM=sh.gram_off[k],
                        M=sh.m_off[k],
                        CHUNK=sh.chunk[k],
                        HI=base + 4 * sh.split_off[k],
                        LO=base + 4 * (sh.split_total + sh.split_off[k]) if self.lo else 0,
                    )
                    for k, ((th, ph, g), (n, p)) in enumerate(zip(ops.ptrs, np_list))
                ],
                torch.int64,
                device,
            ),
        )

        with phase("gram"):
            # the split pass: hi = tf32(θ), lo = tf32(θ − hi)
            items = sh.split_work.shape[0]
            triton_launch.launch(
                TC.tc_split_kernel,
                (triton_launch.persistent(items, device),),
                self.meta,
                sh.split_work,
                items,
                LO=self.lo,
                **self.consts,
                **TC.SPLIT_CONFIG,
            )
            # pass 1: one TF32 GEMM pass over every tile of hiᵀ[hi | lo | Φ | g] and ΦᵀΦ (into slabs
            # kept like the split buffer: every entry the gather reads is written first)
            size = sh.splits * sh.gram_total
            partial = _split_buffers.get_or(
                ("tc-gram", device, owners, size), lambda: torch.empty(size, dtype=torch.float32, device=device)
            )
            items = sh.gram_work.shape[0]
            triton_launch.launch(
                TC.tc_gram_kernel,
                (triton_launch.persistent(items, device),),
                self.meta,
                sh.gram_work,
                items,
                partial,
                sh.gram_total,
                PRECISION="tf32",
                **self.consts,
                **self.gram_config,
            )
        # the splits summed, the symmetric blocks' lower tiles mirrored and A = hiᵀhi + L + Lᵀ,
        # into the middle's layout: one launch (kernels/blocks.py)
        gather = _gatherer(partial, sh.splits, has_phi, predict, mirror=True, lo=self.lo, upper=self.gram_config["BM"])

        runs = runs_of([(p, has_phi) for _, p in np_list], [meta.TC_GRAM_SLOTS] * len(np_list))
        fused = fused_middle.applies(dtype=torch.float32, variant=variant, max_distance=max_distance)
        guard = _guard(ops, trust_radius, max_distance, variant, fused=fused, precision=precision)
        with phase("middle"):
            if fused:
                # the middle and the guard in nine launches (fused_middle.py)
                self.fused(gather, runs, guard, precision, ("tc-middle", device, owners, has_phi))
            else:
                self.middle(
                    partial, runs, gather=gather, products=mid_products.engine(precision), precision=precision, **guard
                )
        self.programs = triton_launch.persistent(sh.update_work.shape[0], device)
        # the update kernel's ALIGNED hints claim M_θ and M_Φ 16-byte aligned (the middle's buffers,
        # offsets sums of p² with p a multiple of 4): a hint that does not hold is a wrong 16-byte
        # load on a GPU, so refuse here, before any write
        if aligned and any(m is not None and m.data_ptr() % 16 for m in (self.m_theta, self.m_phi)):
            raise RuntimeError(
                "fgd_fast internal error: the middle's M blocks are not 16-byte aligned for the aligned "
                "tensor-core update; nothing was written. Please report it; backend='torch' steps meanwhile"
            )

    def _apply(self) -> None:
        sh = self.shapes
        items = sh.update_work.shape[0]
        triton_launch.launch(
            TC.tc_update_kernel,
            (self.programs,),
            self.meta,
            self.hyper_step,
            sh.update_work,
            items,
            self.m_theta,
            self.m_phi,
            HAS_PHI=self.has_phi,
            PRECISION="tf32",
            **self.consts,
            **self.update_config,
        )
        self.ops.write_back()


def prepare_triton(
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
    needs_cuda("triton", params, allow=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))
    tensor_cores = precision in TC.PRECISIONS

    def key(i: int) -> tuple:
        shape = stiefel_shape(params[i].shape)
        dtype, has_phi = params[i].dtype, bufs[i] is not None
        # the tensor-core kernels' 16-byte loads and larger tiles are chosen per class: aligned
        # layers form their own class, so that one odd layer does not slow the others down
        aligned = None
        if dtype == torch.float32 and tensor_cores:
            own = (params[i], grads[i]) + ((bufs[i],) if has_phi else ())
            aligned = tables.aligned(own, [(shape.n, shape.p)])
        return dtype, has_phi, shape.transposed, aligned

    classes = layer_classes(len(params), key)
    built = []
    for (dtype, has_phi, rows, _), idx in classes.items():
        if dtype == torch.float32 and tensor_cores:
            built.append(
                _TensorCoreClass(
                    idx,
                    params,
                    grads,
                    bufs,
                    lr,
                    momentum,
                    feedback,
                    has_phi,
                    rows,
                    precision,
                    trust_radius,
                    max_distance,
                    variant,
                )
            )
        else:
            built.append(
                _Class(
                    idx,
                    params,
                    grads,
                    bufs,
                    lr,
                    momentum,
                    feedback,
                    dtype,
                    has_phi,
                    rows,
                    precision,
                    trust_radius,
                    max_distance,
                    variant,
                )
            )
    return plan_of(built, device_of(params), check_finite, written=(params, bufs))  # (written in place)


prepare_triton.device_lr = True  # takes lr as tensors (read on the device: base.hyper_table)
