"""Where the Triton step's time goes, and which kernel configuration is fastest (GPU only).

Usage (repository root, on a GPU machine, after ``gpu_check.py`` or an editable install)::

    python -m benchmarks.gpu.triton_probe OUT.json [--budget 180] [--workload wrn-28-10]

On the full-size workload (default WRN-28-10, rule "official"), with ``triton.testing.do_bench``
(median of CUDA-event timings after warm-up, random data):

1. the reference points: an fp32 ``bmm`` Gram ``θᵀθ`` of the same layers (TF32 off), and the
   whole step of ``backend="torch"``;
2. the Triton step split into its phases: the Gram launches, prepare (Gram + middle), apply
   (the update launches), for each precision;
3. a sweep of the tensor-core kernels' Gram and update configurations
   (``kernels/tc_step.py``, precision ``--precision``, default ``"tf32x3"``, the aligned
   entry: WRN-28-10's layers are aligned), each timed alone with the other kernel at its
   default. A configuration measured here is only a candidate: it is selectable only after
   ``kernels/aot.py`` compiles it for sm_80 and sm_90 without spills and with tensor-core
   products.

Results go to OUT.json as they come (a run cut off keeps what it measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

# square Gram tiles (the symmetric blocks store tiles i <= j of a square tiling); BK and BR
# at most the 128-row padding of the split buffers
GRAM_CANDIDATES = [
    dict(BM=128, BN=128, BK=32, num_warps=8, num_stages=4),
    dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=2),
    dict(BM=128, BN=128, BK=32, num_warps=4, num_stages=3),
    dict(BM=64, BN=64, BK=32, num_warps=4, num_stages=4),
    dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=3),
]
UPDATE_CANDIDATES = [
    dict(BR=128, BN=128, BK=32, num_warps=8, num_stages=3),
    dict(BR=128, BN=64, BK=64, num_warps=8, num_stages=2),
    dict(BR=64, BN=64, BK=32, num_warps=4, num_stages=3),
    dict(BR=128, BN=64, BK=32, num_warps=4, num_stages=4),
    dict(BR=64, BN=128, BK=32, num_warps=8, num_stages=3),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--budget", type=float, default=180.0)
    ap.add_argument("--workload", default="wrn-28-10")
    ap.add_argument("--precision", default="tf32x3", choices=("tf32x3", "tf32"), help="precision of the sweep")
    ap.add_argument(
        "--base",
        help='JSON {"gram": {...}, "update": {...}}: the configurations to start from (default: the shipped ones)',
    )
    ap.add_argument("--gram", help="JSON list of Gram candidates (default: GRAM_CANDIDATES)")
    ap.add_argument("--update", help="JSON list of update candidates (default: UPDATE_CANDIDATES)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="rehearse on a CPU (TRITON_INTERPRET=1, tiny shapes)")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget

    import fgd_fast
    from benchmarks.machine import environment
    from benchmarks.workloads import layer_shapes, weight_shapes, workloads
    from fgd_fast.backends import triton as TB
    from fgd_fast.functional import fgd
    from fgd_fast.kernels import tc_step as K

    key = (args.precision, True)  # the aligned entry
    if args.base:
        base = json.loads(args.base)
        K.GRAM_CONFIG[key] = base.get("gram", K.GRAM_CONFIG[key])
        K.UPDATE_CONFIG[key] = base.get("update", K.UPDATE_CONFIG[key])
    gram_candidates = json.loads(args.gram) if args.gram else GRAM_CANDIDATES
    update_candidates = json.loads(args.update) if args.update else UPDATE_CANDIDATES
    precisions = ("ieee", "tf32x3", "tf32")
    if args.cpu_dry_run:  # the interpreter is slow: one precision, one candidate of each kernel
        gram_candidates, update_candidates, precisions = gram_candidates[:1], update_candidates[:1], (args.precision,)
    dev = torch.device("cpu" if args.cpu_dry_run else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.cpu_dry_run:  # rehearsal under the interpreter: tiny shapes, wall-clock timing

        def do_bench(fn):
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    else:
        import triton.testing

        def do_bench(fn):  # (its default is the mean: outliers of a shared host would skew a sweep)
            return triton.testing.do_bench(fn, return_mode="median")

    w = {x.name: x for x in workloads("tiny" if args.cpu_dry_run else "full")}[args.workload]
    shapes = weight_shapes(w)
    np_list = layer_shapes(w)
    out: dict = {
        "environment": environment(dev),
        "workload": args.workload,
        "layers": np_list,
        "base": {"gram": K.GRAM_CONFIG[key], "update": K.UPDATE_CONFIG[key]},
        "results": [],
    }
    path = Path(args.out)

    def record(**kw):
        out["results"].append(kw)
        path.write_text(json.dumps(out, indent=1, default=str))
        print(json.dumps(kw), flush=True)

    g = torch.Generator(device=dev).manual_seed(0)
    params = [fgd_fast.orthogonalize_(torch.randn(s, device=dev, generator=g)) for s in shapes]
    grads = [torch.randn(s, device=dev, generator=g) / 100 for s in shapes]
    flops = 10 * sum(n * p * p for n, p in np_list)

    def fresh_bufs():
        return [torch.randn(s, device=dev, generator=g) / 1000 for s in shapes]

    bufs = fresh_bufs()

    def prepare_plan(precision):
        """The Triton backend's plan for one step (Gram pass and middle, nothing written)."""
        return TB.prepare_triton(
            params,
            grads,
            bufs,
            [False] * len(params),
            lr=[1e-4] * len(params),
            momentum=[0.9] * len(params),
            feedback=[0.4] * len(params),
            check_finite=False,
            precision=precision,
        )

    def step(backend, **kw):
        # timing only: thousands of steps on one fixed gradient drift θ, so no checks
        fgd(
            params,
            grads,
            bufs,
            lr=1e-4,
            momentum=0.9,
            feedback=0.4,
            backend=backend,
            check_manifold=False,
            check_finite=False,
            **kw,
        )

    # 1. reference points
    thetas = [p.reshape(p.shape[0], -1) for p in params]
    thetas = [t if t.shape[0] >= t.shape[1] else t.T for t in thetas]
    by_shape: dict = {}
    for t in thetas:
        by_shape.setdefault(tuple(t.shape), []).append(t)
    stacks = [torch.stack(v) for v in by_shape.values()]
    ms = do_bench(lambda: [torch.bmm(s.transpose(1, 2), s) for s in stacks])
    record(
        what="torch bmm Gram A (fp32)",
        ms=ms,
        tflops=sum(2 * s.shape[0] * s.shape[1] * s.shape[2] ** 2 for s in stacks) / ms / 1e9,
    )
    ms = do_bench(lambda: step("torch", precision="ieee"))
    record(what="step torch ieee", ms=ms, tflops=flops / ms / 1e9)

    # 2. phases of the Triton step
    for precision in precisions:
        if time.monotonic() > deadline:
            break
        ms = do_bench(lambda precision=precision: step("triton", precision=precision))
        record(what=f"step triton {precision}", ms=ms, tflops=flops / ms / 1e9)
        plan_box = {}

        def prep(plan_box=plan_box, precision=precision):
            plan_box["plan"] = prepare_plan(precision)

        ms = do_bench(prep)
        record(what=f"prepare (gram + middle) {precision}", ms=ms)
        ms = do_bench(lambda plan_box=plan_box: plan_box["plan"].apply())
        record(what=f"apply (update) {precision}", ms=ms)

    # 3. configuration sweeps of the tensor-core kernels
    def phase_times(label, table, key, cfg):
        old = table[key]
        table[key] = cfg
        try:
            t0 = time.monotonic()
            step("triton", precision=args.precision)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            compile_s = time.monotonic() - t0
            box = {}

            def prep():
                box["plan"] = prepare_plan(args.precision)

            p_ms = do_bench(prep)
            a_ms = do_bench(lambda: box["plan"].apply())
            record(what=f"sweep {label}", cfg=cfg, prepare_ms=p_ms, apply_ms=a_ms, compile_s=compile_s)
        except Exception as exc:  # a candidate that fails to compile or run is a result too
            record(what=f"sweep {label}", cfg=cfg, error=repr(exc)[:300])
        finally:
            table[key] = old

    for gc, uc in itertools.zip_longest(gram_candidates, update_candidates):
        for label, table, cfg in (("gram", K.GRAM_CONFIG, gc), ("update", K.UPDATE_CONFIG, uc)):
            if cfg is not None and time.monotonic() < deadline:
                phase_times(label, table, key, cfg)
    # the persistent grids: programs per SM
    from fgd_fast.backends import triton_launch  # (where the persistent grids ask for their programs)

    for per_sm in (1,) if args.cpu_dry_run else (1, 4):  # (the dry run: one, so a renamed hook fails here)
        if time.monotonic() > deadline:
            break
        old = triton_launch.programs_wanted
        triton_launch.programs_wanted = lambda d, k=per_sm: (
            2 * k * (torch.cuda.get_device_properties(d).multi_processor_count if d.type == "cuda" else 1)
        )
        try:
            ms = do_bench(lambda: step("triton", precision=args.precision))
            record(what=f"step triton {args.precision}, persistent programs {per_sm}/SM", ms=ms)
        finally:
            triton_launch.programs_wanted = old
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
