"""Package discovery for setuptools; all metadata is in pyproject.toml.

configs/ (cost models, deployment configs) lives at the top of the repo, as the design card
lays it out, and ships inside the package as ``qla_serve.configs`` so an installed wheel finds
it with importlib.resources.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["qla_serve", "qla_serve.*"]) + ["qla_serve.configs"],
    package_dir={"qla_serve.configs": "configs"},
    package_data={"qla_serve.configs": ["*.yaml", "*/*.yaml"],
                  "qla_serve.kernels.hopper": ["csrc/*.cc", "csrc/*.cuh"]},
)
