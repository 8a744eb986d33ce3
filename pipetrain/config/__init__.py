"""Recipes: what a run is, as data. The package's public face is this list of names, and importers use it
(`from pipetrain.config import Recipe, ConfigError, load_recipe`).

    schema.py      the frozen dataclasses of every section (Recipe, ModelConfig, ParallelConfig, ...),
                   ConfigError, clip, lora_projections, fused_loss_on
    loading.py     YAML (bounded), --set overrides, path resolution, build_recipe, load_recipe, dump_recipe
    validation.py  validate: the rules of the keys config owns, plus the parallel rules it is handed
    arguments.py   ArgumentParser: argparse's, with its errors on one line (every command line uses it)

Why re-export: a recipe's schema and its loader are one public API that nearly every module and test of
pipetrain reads (over a hundred imports), and the split into three files is how config is organised inside,
not something a caller should have to know. Everything not listed here stays inside the package
(import it from its module when a test needs it, e.g. config.loading.MAX_RECIPE_DEPTH).

Layering: config sits below everything (it imports only PyYAML and pipetrain.shipped). The rules on
parallel keys live in pipetrain.parallel.mesh.rules; code that runs a recipe passes
`rules=parallel_problems` to load_recipe / build_recipe / validate, so one ConfigError still lists every
problem at once.
"""
from pipetrain.config.arguments import ArgumentParser
from pipetrain.config.loading import build_recipe, dump_recipe, load_recipe, parse_override, section_type_problems
from pipetrain.config.schema import (CheckpointConfig, ConfigError, DataConfig, FaultsConfig, ModelConfig,
                                     ParallelConfig, Recipe, RunConfig, TrainConfig, clip, fp8_weights_once_a_run,
                                     fused_loss_on, lora_projections)
from pipetrain.config.validation import positive_finite, validate

__all__ = [
    "Recipe", "ModelConfig", "ParallelConfig", "TrainConfig", "DataConfig", "CheckpointConfig", "RunConfig",
    "FaultsConfig", "ConfigError", "clip", "fp8_weights_once_a_run", "fused_loss_on", "lora_projections",
    "load_recipe", "build_recipe", "dump_recipe", "parse_override", "section_type_problems", "validate",
    "ArgumentParser", "positive_finite",
]
