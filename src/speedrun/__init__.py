"""speedrun: train image classifiers to a target accuracy as fast and as cheaply as possible."""
from speedrun.recipe import OptimizerSettings, Phase, Recipe, RecipeError, Target
from speedrun.recipes import load_recipe
from speedrun.tune.lr_find import LRFinding, lr_find
from speedrun.version import __version__

__all__ = ["LRFinding", "OptimizerSettings", "Phase", "Recipe", "RecipeError", "Target", "load_recipe", "lr_find",
           "__version__"]
