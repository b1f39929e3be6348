"""Built-in recipes, by name (`speedrun recipes` lists them), and `load_recipe` for a name or a file."""
import importlib.util
from collections.abc import Callable
from pathlib import Path

from speedrun.recipe import Recipe, RecipeError
from speedrun.recipes.fashion_mnist import fashion_mnist, tiny
from speedrun.recipes.folder import folder_small
from speedrun.recipes.imagenet import imagenet_1x8, imagenet_2x8, imagenet_4x8, imagenet_8x8, imagenet_16x8

# Recipes fitted to the image folder they train on: name -> function of the folder's typical
# image side (px, the median shorter side of its training images) and its training image count.
# `speedrun train` fits them to --data; BUILTIN holds each as fitted to Fashion-MNIST as a folder.
FITTED: dict[str, Callable[[int, int], Recipe]] = {"folder-small": folder_small}

BUILTIN: dict[str, Recipe] = {
    r.name: r
    for r in (fashion_mnist, tiny, folder_small(28, 60_000),
              imagenet_1x8, imagenet_2x8, imagenet_4x8, imagenet_8x8, imagenet_16x8)
}
DEFAULT = fashion_mnist.name


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or the variable `recipe` from a Python file. Validated."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path].validate()
    path = Path(name_or_path)
    if path.suffix != ".py":
        known = ", ".join(sorted(BUILTIN))
        raise RecipeError([f"unknown recipe {name_or_path!r}: not a built-in ({known}) and not a .py file"])
    if not path.is_file():
        raise RecipeError([f"recipe file {str(path)!r} does not exist"])
    spec = importlib.util.spec_from_file_location(f"speedrun_user_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except RecipeError as e:  # a Phase, Target or Recipe the file made refused its values
        raise RecipeError([f"recipe file {str(path)!r}: {p}" for p in e.problems]) from None
    except Exception as e:  # a user's file: report its error in one line
        raise RecipeError([f"recipe file {str(path)!r} failed to load: {type(e).__name__}: {e}"]) from None
    except SystemExit as e:  # exit() in a recipe would end `speedrun train` silently, even with status 0
        raise RecipeError([f"recipe file {str(path)!r} called exit({e.code!r}) while loading; "
                           "a recipe file only defines `recipe`"]) from None
    recipe = getattr(module, "recipe", None)
    if not isinstance(recipe, Recipe):
        raise RecipeError([f"recipe file {str(path)!r} must define a variable `recipe` holding a speedrun.Recipe"])
    return recipe.validate()
