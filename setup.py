"""Build script for fgd_fast.

The Triton kernels live in the top-level ``kernels/`` folder and are installed as
``fgd_fast.kernels`` (a bare top-level ``kernels`` module belongs to another PyPI package).
"""
from setuptools import setup

setup(
    name="fgd_fast",
    version="0.1.0",
    description="Fast Feedback Gradient Descent (orthogonality-constrained training) for PyTorch",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["fgd_fast", "fgd_fast.backends", "fgd_fast.baselines", "fgd_fast.kernels"],
    package_dir={"fgd_fast": "fgd_fast", "fgd_fast.kernels": "kernels"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"triton": ["triton>=3.0"], "test": ["pytest", "pytest-benchmark"]},
)
