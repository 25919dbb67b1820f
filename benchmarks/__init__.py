"""The benchmarks of fgd_fast (not part of the installed package; run from the repository root).

* the optimizer-step benchmark: ``python -m pytest benchmarks`` (``benchmarks/run.sh`` sets up,
  runs it and the training comparison, and reports; ``python -m benchmarks.report`` renders a
  result file);
* :mod:`benchmarks.training`: the training comparison (``python -m benchmarks.training``) and
  its lr sweep (``python -m benchmarks.training.sweep``);
* :mod:`benchmarks.studies`: one-off measurements behind the docs (``python -m
  benchmarks.studies.<name>``);
* :mod:`benchmarks.gpu`: the tooling of a GPU session (``benchmarks/gpu/README.md``).
"""
