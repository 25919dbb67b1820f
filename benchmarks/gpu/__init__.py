"""The tooling of a GPU session (see ``benchmarks/gpu/README.md``)."""
