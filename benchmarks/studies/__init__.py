"""One-off measurements behind the docs, each ``python -m benchmarks.studies.<name>``:
``feedback_contraction`` and ``variant_distance`` (where FGD settles), ``guard_headroom`` (the
trust radius), ``cpu_backends`` (backends on a CPU), ``cpu_host_ops`` (the torch backend's
host-side choices), ``torch_knobs`` (a torch-backend constant at two values, side by side),
``torch_calls`` (aten ops per step), ``op_counts`` (a step's device operations on the
op-count test's set), ``op_time`` (a step's time op by op: the products' rates),
``step_ratio`` (step times side by side), ``dist_comm`` (communication volume)."""

import os

# Before anything imports torch (this package's __init__ runs first under ``python -m
# benchmarks.studies.<name>``): OpenMP's idle threads sleep instead of spinning, so on a loaded
# machine a study's threads do not burn the cores that the others' work waits for, and its timings
# stay steady. Set OMP_WAIT_POLICY=ACTIVE to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def counts_checked(ap, args, *names: str) -> None:
    """Refuse (``ap.error``) any of the options ``names`` given below 1; then, where ``"threads"``
    is one of them and was given, set torch's CPU threads (before the study's header, which
    reports the count)."""
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:  # (an option of several values: each)
            if v is not None and v < 1:
                ap.error(f"--{name} {v}: must be at least 1")
    if "threads" in names and args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
