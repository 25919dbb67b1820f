"""The work one step must do, and the floor it implies (one concern: the cost model).

For FGD's two-pass form (``docs/algorithm.md`` §4): a Gram pass (A, C symmetric:
``n·p²`` flops each; B, E: ``2·n·p²`` each) and an update pass (``4·n·p²``), i.e.
``10·Σ n·p²`` flops; memory traffic: read θ, Φ, g twice and write θ, Φ once, i.e.
``8·Σ n·p`` float32 values = ``32·Σ n·p`` bytes. The O(p³) algebra is left out, and so is
the guard's velocity Gram (G and H: ``3·n·p²`` more in the fused backends; UᵀU: ``n·p²`` in
the torch backend): the model is the update's own work, a lower bound for a guarded step.

For ``torch.optim.SGD`` with momentum: ``b ← βb + g``, ``θ ← θ − ηb`` are a multiply and an
add each per element, ``4·Σ n·p`` flops, and read θ, g, b and write b, θ: ``20·Σ n·p`` bytes
(reports before 2026-11-29 counted 3 flops: their ``sgd`` rows' rate percentages are ¾ of this
count's).

Other contenders get no model (their minimum work depends on the algorithm); the report
shows their time against FGD's floor instead. The floor of a step is
``max(flops / matmul rate, bytes / copy bandwidth)`` with both rates measured in the run.
"""

from __future__ import annotations

__all__ = ["step_cost", "floor_seconds"]

FLOAT32 = 4


def step_cost(family: str, shapes: list[tuple[int, int]]) -> dict[str, float] | None:
    """``{"flops", "bytes"}`` of one step of a contender of ``family`` on ``shapes``, or None."""
    np2 = float(sum(n * p * p for n, p in shapes))
    np1 = float(sum(n * p for n, p in shapes))
    if family == "fgd":
        return {"flops": 10.0 * np2, "bytes": 8.0 * FLOAT32 * np1}
    if family == "sgd":
        return {"flops": 4.0 * np1, "bytes": 5.0 * FLOAT32 * np1}
    return None


def floor_seconds(cost: dict[str, float], rates: dict[str, float]) -> dict[str, float]:
    """Compute floor, memory floor and their maximum (seconds) for ``cost`` at ``rates``."""
    compute = cost["flops"] / rates["matmul_flops"]
    memory = cost["bytes"] / rates["copy_bytes_per_s"]
    return {"compute_s": compute, "memory_s": memory, "floor_s": max(compute, memory)}
