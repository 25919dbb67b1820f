"""Baseline optimizers users compare FGD against (Cayley SGD / ADAM and adapters).

* :class:`CayleySGD`, :class:`CayleyADAM` — Li, Li & Todorovic (ICLR 2020), with the momentum
  the public code loses kept, ``s`` as a parameter, a low-rank form that never builds the
  ``n × n`` skew matrix, and ``public_code_compat=True`` to reproduce the public code.
* :class:`LandingSGD` — the landing algorithm on St(n, p) (Ablin & Peyré 2022; Ablin, Vary,
  Gao & Absil 2023) with momentum and the safe step size: retraction-free and O(np²) like FGD.
* :mod:`fgd_fast.baselines.adapters` — contenders built from other libraries (geoopt's
  ``RiemannianSGD`` on the Euclidean or canonical Stiefel manifold, and
  ``torch.nn.utils.parametrizations.orthogonal`` + SGD). geoopt is imported only when an
  adapter that needs it is called, so this package imports without it.
"""

from .adapters import StiefelView, geoopt_stiefel_sgd, torch_orthogonal_sgd
from .cayley import CayleyADAM, CayleySGD
from .landing import LandingSGD

__all__ = ["CayleySGD", "CayleyADAM", "LandingSGD", "StiefelView", "geoopt_stiefel_sgd", "torch_orthogonal_sgd"]
