"""One-off measurements behind the docs, each ``python -m benchmarks.studies.<name>``:
``feedback_contraction`` and ``variant_distance`` (where FGD settles), ``guard_headroom`` (the
trust radius), ``cpu_backends`` (backends on a CPU), ``cpu_host_ops`` (the torch backend's
host-side choices), ``torch_knobs`` (a torch-backend constant at two values, side by side),
``torch_calls`` (aten ops per step), ``op_time`` (a step's time op by op: the products' rates),
``step_ratio`` (step times side by side), ``dist_comm`` (communication volume)."""
