"""``python -m benchmarks.training``: the training comparison (see :mod:`benchmarks.training.train`)."""

import sys

from .train import main

sys.exit(main())
