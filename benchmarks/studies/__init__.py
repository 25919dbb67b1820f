"""One-off measurements behind the docs, each ``python -m benchmarks.studies.<name>``:
``feedback_contraction`` and ``variant_distance`` (where FGD settles), ``guard_headroom`` (the
trust radius), ``cpu_backends`` (backends on a CPU), ``dist_comm`` (communication volume)."""
