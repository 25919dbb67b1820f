"""FGD across processes: communication per step (model) and a short measured gloo run.

    python -m benchmarks.studies.dist_comm                  # model table + measured run, prints the report
    python -m benchmarks.studies.dist_comm --out FILE.md    # ... and writes it
    python -m benchmarks.studies.dist_comm --model-only     # the model table only (seconds)

**Model** — bytes each rank sends per optimizer step for the constrained layers of the
full-size benchmark workloads (:mod:`workloads`) and of a Llama-style 7B block set (32 blocks
of q, k, v, o 4096 × 4096, gate and up 11008 × 4096, down 4096 × 11008), float32, ring
collectives, at 8, 64 and 512 ranks; with ``R`` ranks, a layer θ of ``n × p``, ``s`` bytes
per number:

* *row shards + one all-reduce of every block* (A, E, B, C and the guard's UᵀU, plus ‖g‖²):
  ``2(R−1)/R · (5p² + 1) · s`` per row-sharded layer; a layer that ``shard_placement``
  cannot row-shard at ``R`` (no input dimension divisible by ``R``) is counted with the
  all-gather fallback below;
* *same, A, C and UᵀU as triangles* (what fgd_fast does for a row shard):
  ``2(R−1)/R · (2p² + 3p(p+1)/2 + 1) · s``;
* *all-gather θ, Φ, g, compute redundantly* (``sharding="gather"``, and the fallback where no
  other path fits): ``(R−1)/R · 3np · s``;
* *owner* (fgd_fast's owner path, ``fgd_fast.owners``): θ, g and Φ go to the matrix's owner
  rank, θ₊ and Φ₊ come back: ``5np · s · (R−1)/R²`` per matrix, the average over the ranks
  (matrices dealt largest first to the least loaded rank); *owner, busiest rank*: what the
  busiest rank sends or receives (few large matrices on many ranks: the owner of the largest
  carries ~5np, not 5np/R);
* *fgd_fast auto*: what ``FGD(sharding="auto")`` picks with ``fgd_fast.shard_placement``
  (``fgd_fast.distributed.moved_to_owners``: layers that are not row shards at ``R`` on the
  owner path, row shards moved there where that lightens the busiest rank), counted at its
  busiest rank: the row all-reduce of the layers left plus the owner path's busiest rank;
  *auto calls* counts its collectives per step (the settings' agreement, the packed
  all-reduces of 64 MiB buckets, and, with owner layers, two all-to-alls and the checks'
  all-reduce);
* for scale, FSDP2's own traffic for these parameters: all-gather in forward and backward,
  reduce-scatter of the gradient: ``3 · (R−1)/R · np · s``.

**Measured** — a gloo process group of 2 and 4 CPU processes (one torch thread each) runs
the optimizer step of the ``cpu``-scale WRN-28 workload under FSDP2 (gradients set directly,
no forward/backward): FGD with ``shard_placement`` (row shards summed, or every layer on its
owner), FGD with FSDP2's default placement (the owner path for most layers, or the all-gather
of ``sharding="gather"``) and ``torch.optim.SGD`` (momentum 0.9, its default foreach path) on
the same model. It reports the median step time (barrier to
barrier, rank 0) and the bytes the step's collectives carried per rank.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch

import fgd_fast
from benchmarks.machine import describe, environment
from benchmarks.studies import counts_checked
from fgd_fast._matrix import stiefel_shape
from fgd_fast.collectives import BUCKET_BYTES
from fgd_fast.distributed import moved_to_owners, path_bytes
from fgd_fast.owners import busiest_bytes

FLOAT32 = 4
SCHEMES = (
    "rows, all blocks",
    "rows, triangles",
    "all-gather",
    "owner",
    "owner, busiest rank",
    "fgd_fast auto",
    "auto calls",
    "FSDP2 params+grads",
)
RANKS = (8, 64, 512)
#: the measured runs: (name, FGD's sharding)
CONFIGS = (
    ("FGD, shard_placement, auto", "auto"),
    ("FGD, shard_placement, owner", "owner"),
    ("FGD, default placement, auto", "auto"),
    ("FGD, default placement, gather", "gather"),
    ("torch SGD", None),
)


def llama_7b_blocks(blocks: int = 32, d: int = 4096, hidden: int = 11008) -> list[tuple[int, int]]:
    """The weight shapes of a Llama-style 7B model's blocks (attention q, k, v, o; MLP gate, up,
    down), every one constrained."""
    return [(d, d)] * 4 * blocks + [(hidden, d)] * 2 * blocks + [(d, hidden)] * blocks


def _row_sharded(shape, ranks: int) -> bool:
    placement = fgd_fast.shard_placement(torch.empty(shape, device="meta"), world_size=ranks)
    return (placement.dim >= 1) == stiefel_shape(shape).transposed


def volume(shapes, ranks: int, s: int = FLOAT32) -> dict[str, float]:
    """Bytes sent per rank per step, per scheme, for float32 weights of ``shapes`` on ``ranks``
    ranks (and ``auto calls``: the collectives per step of ``sharding="auto"``)."""
    assert s == FLOAT32, "the fgd_fast columns are float32's"
    out = dict.fromkeys(SCHEMES, 0.0)
    summable, owned = [], []
    for shape in shapes:
        n, p, _ = stiefel_shape(shape)
        meta = torch.empty(shape, device="meta")
        cost = path_bytes(meta, meta, ranks)
        if _row_sharded(shape, ranks):
            out["rows, all blocks"] += 2 * (ranks - 1) / ranks * (5 * p * p + 1) * s
            out["rows, triangles"] += cost["rows"]
            summable.append((meta, meta))
        else:
            out["rows, all blocks"] += cost["gather"]
            out["rows, triangles"] += cost["gather"]
            owned.append((meta, meta))
        out["all-gather"] += cost["gather"]
        out["owner"] += cost["owner"]
        out["FSDP2 params+grads"] += 3 * (ranks - 1) / ranks * n * p * s
    out["owner, busiest rank"] = busiest_bytes(summable + owned, ranks)
    moved = set(moved_to_owners(summable, owned, ranks))  # FGD(sharding="auto")'s choice
    summed = sum(path_bytes(m, b, ranks)["rows"] for k, (m, b) in enumerate(summable) if k not in moved)
    onto = owned + [summable[k] for k in sorted(moved)]
    out["fgd_fast auto"] = summed + busiest_bytes(onto, ranks)
    # the agreement; the row blocks in 64 MiB all-reduces (each rank's payload is summed / 2·ring)
    ring = (ranks - 1) / ranks
    calls = 1 + (math.ceil(summed / (2 * ring) / BUCKET_BYTES) if summed else 0)
    out["auto calls"] = calls + (3 if onto else 0)
    return out


def model_table(rank_counts=RANKS) -> str:
    from benchmarks.workloads import workloads

    sets = []
    for w in workloads("full"):
        with torch.device("meta"):
            torch.manual_seed(0)
            model = w.build()
        sets.append((w.name, [p.shape for _, p in fgd_fast.select_stiefel(model, w.rule)]))
    sets.append(("llama-7b blocks", llama_7b_blocks()))
    lines = ["| workload | layers | ranks | " + " | ".join(SCHEMES) + " |", "|---|---:|---:|" + "---:|" * len(SCHEMES)]
    for name, shapes in sets:
        for ranks in rank_counts:
            v = volume(shapes, ranks)
            cells = " | ".join(f"{v[k]:.0f}" if k == "auto calls" else f"{v[k] / 1e6:,.1f}" for k in SCHEMES)
            lines.append(f"| {name} | {len(shapes)} | {ranks} | {cells} |")
    return "\n".join(lines)


# -- the measured run ---------------------------------------------------------------------------
class _Bytes:
    """Bytes per rank the FGD step's collectives carry — all-reduce payloads (ring: 2(R−1)/R of
    them sent), the fallback's packed all-gathers and per-tensor ``full_tensor()`` gathers
    (ring: (R−1)/R of the gathered bytes) — and the seconds spent in them (an asynchronous
    all-reduce counts its ``wait()``)."""

    def __init__(self, world):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        self.total, self.seconds, self.world = 0.0, 0.0, world
        ring = (world - 1) / world
        all_reduce, full_tensor = dist.all_reduce, DTensor.full_tensor
        # (fgd_fast gathers with all_gather_single where torch has it, all_gather_into_tensor before)
        gathers = {
            name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)
        }
        all_to_all = dist.all_to_all_single
        counter = self

        class Timed:
            def __init__(self, work):
                self.work = work

            def wait(self, *args, **kwargs):
                t0 = time.perf_counter()
                out = self.work.wait(*args, **kwargs)
                counter.seconds += time.perf_counter() - t0
                return out

        def timed(call, nbytes):
            def run(*args, **kwargs):
                t0 = time.perf_counter()
                out = call(*args, **kwargs)
                self.seconds += time.perf_counter() - t0
                self.total += nbytes(*args)
                return Timed(out) if kwargs.get("async_op") else out

            return run

        dist.all_reduce = timed(all_reduce, lambda t, *a: 2 * ring * t.nbytes)
        for name, gather in gathers.items():
            setattr(dist, name, timed(gather, lambda out, *a: ring * out.nbytes))
        DTensor.full_tensor = timed(full_tensor, lambda t, *a: ring * t.numel() * t.element_size())

        def to_others(out, inp, out_splits=None, in_splits=None, *a):  # (not this rank's own part)
            me = dist.get_rank(a[0] if a else None) if in_splits else 0
            return (inp.numel() - (in_splits[me] if in_splits else inp.numel() / world)) * inp.element_size()

        dist.all_to_all_single = timed(all_to_all, to_others)


def _rank_main(rank, world, init, steps, queue):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from benchmarks.workloads import workloads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    work = next(w for w in workloads("cpu") if w.name == "wrn-28-10")
    counter = _Bytes(world)
    results = {}
    for name, sharding in CONFIGS:
        model = work.model()
        placement = fgd_fast.shard_placement if "shard_placement" in name else None
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
        if name == "torch SGD":
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            groups = fgd_fast.stiefel_param_groups(model, work.rule, orthogonalize=False)
            opt = fgd_fast.FGD(groups, lr=0.1, momentum=0.9, feedback=0.4, sharding=sharding)
        gen = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            local = 1e-3 * torch.randn(p.to_local().shape, generator=gen)
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        times, sent, waits = [], [], []
        for step in range(steps + 2):  # 2 warm-up steps
            dist.barrier()
            counter.total = counter.seconds = 0.0
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            if step >= 2:
                times.append(time.perf_counter() - t0)
                sent.append(counter.total)
                waits.append(counter.seconds)
        results[name] = dict(
            ms=1e3 * statistics.median(times), mb=statistics.median(sent) / 1e6, comm_ms=1e3 * statistics.median(waits)
        )
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def single_process(steps: int) -> dict:
    """FGD and SGD on the whole model in this process (one thread, no process group)."""
    from benchmarks.workloads import workloads

    torch.set_num_threads(1)
    work = next(w for w in workloads("cpu") if w.name == "wrn-28-10")
    out = {}
    for name in ("FGD", "torch SGD"):
        model = work.model()
        if name == "torch SGD":
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        else:
            opt = fgd_fast.FGD(
                fgd_fast.stiefel_param_groups(model, work.rule, orthogonalize=False), lr=0.1, momentum=0.9, feedback=0.4
            )
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
        times = []
        for step in range(steps + 2):
            t0 = time.perf_counter()
            opt.step()
            if step >= 2:
                times.append(time.perf_counter() - t0)
        out[name] = dict(ms=1e3 * statistics.median(times), mb=0.0, comm_ms=0.0)
    return out


def measure(world: int, steps: int) -> dict:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.fsdp", "torch._dynamo", "fgd_fast"])
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, steps, queue)) for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--model-only", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--machine", default="", help="a description of the machine for the report")
    args = parser.parse_args()
    counts_checked(parser, args, "steps")
    report = ["# FGD across processes: communication per step", ""]
    if args.machine:
        report += [f"Machine: {args.machine}", ""]
    report += [f"Run: {describe(environment(torch.device('cpu')))}", ""]
    report += [
        "## Model (MB sent per rank per optimizer step, float32, full-size workloads)",
        "",
        model_table(),
        "",
        'Schemes as in `benchmarks/studies/dist_comm.py`. "rows" counts the layers `shard_placement` cannot '
        "row-shard at that rank count with the all-gather fallback.",
        "",
    ]
    if not args.model_only:
        from benchmarks.workloads import workloads

        work = next(w for w in workloads("cpu") if w.name == "wrn-28-10")
        report += [
            f"## Measured: gloo, optimizer step of {work.description} under FSDP2 (torch {torch.__version__})",
            "",
            "| ranks | optimizer | step (ms, median) | of which in collectives (ms) | sent per rank (MB) |",
            "|---:|---|---:|---:|---:|",
        ]
        runs = [(1, single_process(args.steps))] + [(world, measure(world, args.steps)) for world in (2, 4)]
        for world, results in runs:
            for name, r in results.items():
                report.append(f"| {world} | {name} | {r['ms']:.1f} | {r['comm_ms']:.1f} | {r['mb']:.2f} |")
        report += [
            "",
            "1 rank: the whole model in one process, no FSDP2. One torch thread per process; with 4 "
            "processes on 2 cores the ranks also wait for a core, so the 4-rank times are upper bounds.",
            "",
        ]
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
