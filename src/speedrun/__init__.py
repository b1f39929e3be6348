"""speedrun: train image classifiers to a target accuracy as fast and as cheaply as possible."""
from speedrun.recipe import OptimizerSettings, Phase, Recipe, RecipeError, Target
from speedrun.recipes import load_recipe

__version__ = "0.1.0"
__all__ = ["OptimizerSettings", "Phase", "Recipe", "RecipeError", "Target", "load_recipe", "__version__"]
