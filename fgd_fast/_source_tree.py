"""``fgd_fast.kernels`` in a source tree: the folder ``kernels/`` beside the package.

``setup.py`` installs the top-level ``kernels/`` folder as ``fgd_fast.kernels`` (a bare
``kernels`` module belongs to another PyPI package). An installed package has it in place, an
editable install's finder maps it; Python started in a source tree (a clone, an unpacked sdist)
with a regular install elsewhere imports the tree's ``fgd_fast/`` first, which has no
``kernels/``. Here the tree's ``kernels/`` becomes ``fgd_fast.kernels`` (its modules import
Triton only when they are imported themselves).
"""

from __future__ import annotations

import importlib.util
import os
import sys


def map_kernels_beside(package_dir: str) -> None:
    """Register ``<tree>/kernels`` as ``fgd_fast.kernels`` where the package lies in a tree that
    has one (and no other finder provides it)."""
    beside = os.path.join(os.path.dirname(package_dir), "kernels")
    init = os.path.join(beside, "__init__.py")
    if "fgd_fast.kernels" in sys.modules or not os.path.isfile(init):
        return
    if importlib.util.find_spec("fgd_fast.kernels") is not None:  # (an editable install's finder maps it)
        return
    spec = importlib.util.spec_from_file_location("fgd_fast.kernels", init, submodule_search_locations=[beside])
    module = importlib.util.module_from_spec(spec)
    sys.modules["fgd_fast.kernels"] = module
    spec.loader.exec_module(module)
