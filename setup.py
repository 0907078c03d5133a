"""Package list for setuptools (the metadata is in pyproject.toml).

The CUDA sources live in the top-level ``csrc/`` and install as ``dsx/csrc`` (package data), where
``dsx.ops.unified_gather.csrc_dir`` finds them in a wheel install; an editable install reads ``csrc/``.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["dsx", "dsx.*"]), "dsx.csrc"],
    package_dir={"dsx.csrc": "csrc"},
)
