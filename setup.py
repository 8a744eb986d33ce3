"""Package discovery for the build (pyproject.toml holds the project's metadata).

Every package under pipetrain/ is discovered, so a new sub-package can never be left out of a wheel
(a hand-written list once left out pipetrain.plan, which the CLI imports). Two top-level folders install
under other names, which pyproject.toml's static tables cannot combine with discovery:
- kernels/ as pipetrain.kernels, so it never shadows the unrelated PyPI package named "kernels";
- recipes/ as pipetrain.recipes (the YAML files only), so an installed pipetrain runs `--recipe tiny`
  (pipetrain/shipped.py). recipes/ stays the one copy in git, where the docs and `--recipe recipes/tiny.yaml` find it.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["pipetrain", "pipetrain.*"]) + ["pipetrain.kernels", "pipetrain.recipes"],
    package_dir={"pipetrain": "pipetrain", "pipetrain.kernels": "kernels", "pipetrain.recipes": "recipes"},
    package_data={"pipetrain": ["assets/SOURCE.md", "assets/shakespeare/*.txt", "assets/tokenizer/*"],
                  "pipetrain.recipes": ["*.yaml"]},
)
