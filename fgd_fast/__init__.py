"""fgd_fast: Feedback Gradient Descent (Bu & Chang, AAAI 2022) for PyTorch.

FGD trains weights that stay orthonormal (on the Stiefel manifold) at the cost of SGD plus a
few matrix products: a feedback term pulls θ back to θᵀθ = I every step, with no QR, SVD,
inverse or retraction. Quick start::

    import fgd_fast
    groups = fgd_fast.stiefel_param_groups(model, rule="paper")  # selects + orthonormalises
    opt = fgd_fast.FGD(groups, lr=0.2, momentum=0.9, feedback=0.4, weight_decay=5e-4)
"""

import os as _os

if not _os.path.isdir(_os.path.join(__path__[0], "kernels")):  # (installed, the kernels are fgd_fast/kernels/)
    # a source tree (a clone, an unpacked sdist) imported from its root, not through an editable install's
    # finder: the Triton kernels lie beside the package, in kernels/, which setup.py maps in as fgd_fast.kernels
    from ._source_tree import map_kernels_beside as _map

    _map(__path__[0])

from ._matrix import as_stiefel, from_stiefel, stiefel_shape
from ._version import __version__
from .backends import BACKENDS, BackendUnavailable
from .distributed import shard_placement
from .functional import GuardReport, fgd, sgd
from .manifold import orthogonalize_, stiefel_distance
from .optimizer import FGD
from .selection import select_stiefel, stiefel_param_groups

__all__ = [
    "__version__",
    "BACKENDS",
    "BackendUnavailable",
    "FGD",
    "GuardReport",
    "as_stiefel",
    "fgd",
    "from_stiefel",
    "orthogonalize_",
    "select_stiefel",
    "sgd",
    "shard_placement",
    "stiefel_distance",
    "stiefel_param_groups",
    "stiefel_shape",
]
