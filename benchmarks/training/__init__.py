"""The training comparison: ``python -m benchmarks.training`` (:mod:`.train`), the optimizers it
compares (:mod:`.optimizers`), its data (:mod:`.data`), its report (:mod:`.report`), and a small
lr × second-knob sweep on digits (``python -m benchmarks.training.sweep``)."""
