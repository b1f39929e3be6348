"""Built-in recipes, by name (`speedrun recipes` lists them), and `load_recipe` for a name or a file
(`recipe_source` writes one)."""
import importlib.util
import json
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
    module = run_user_file(path, "recipe", RecipeError)
    recipe = getattr(module, "recipe", None)
    if not isinstance(recipe, Recipe):
        raise RecipeError([f"recipe file {str(path)!r} must define a variable `recipe` holding a speedrun.Recipe"])
    return recipe.validate()


def recipe_file_tracks(name_or_path: str) -> tuple[str, ...]:
    """The `track` a recipe file may define beside `recipe`: --track values (`track = ["mlflow=URI",
    "wandb"]`) for a run given no --track and no SPEEDRUN_TRACK. () for a built-in recipe or a file
    without one; RecipeError for one that is not a string or a list of strings."""
    path = Path(name_or_path)
    if name_or_path in BUILTIN or path.suffix != ".py" or not path.is_file():
        return ()
    track = getattr(run_user_file(path, "recipe", RecipeError), "track", ())
    track = (track,) if isinstance(track, str) else track
    if not isinstance(track, (list, tuple)) or not all(isinstance(t, str) for t in track):
        raise RecipeError([f"recipe file {str(path)!r}: `track` must be a list of --track values "
                           f"such as [\"mlflow=http://host:5000\", \"wandb\"], not {track!r}"])
    return tuple(track)


def run_user_file(path: Path, what: str, error: type[Exception]):
    """Run the user's Python file at `path` (a `what`: "recipe", "search space") and return it as a
    module. Whatever goes wrong in it is one `error` naming the file: a speedrun value it made that
    refused itself, any other exception, or exit() (which would end the command silently)."""
    def refuse(line: str) -> Exception:
        return error([line]) if issubclass(error, RecipeError) else error(line)

    spec = importlib.util.spec_from_file_location(f"speedrun_user_{what.replace(' ', '_')}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except RecipeError as e:  # a Phase, Target or Recipe the file made refused its values
        if issubclass(error, RecipeError):
            raise RecipeError([f"{what} file {str(path)!r}: {p}" for p in e.problems]) from None
        raise refuse(f"{what} file {str(path)!r}: {'; '.join(e.problems)}") from None
    except Exception as e:  # a user's file: report its error in one line
        raise refuse(f"{what} file {str(path)!r} failed to load: {type(e).__name__}: {e}") from None
    except SystemExit as e:  # exit() in the file would end the command silently, even with status 0
        raise refuse(f"{what} file {str(path)!r} called exit({e.code!r}) while loading; "
                     f"a {what} file only defines names") from None
    return module


def recipe_source(recipe: Recipe, header: str) -> str:
    """The text of a recipe file (`speedrun train --recipe FILE`) holding exactly `recipe`, after
    `header` (comment lines or a docstring, with its newline)."""
    return (f"{header}import json\n\nfrom speedrun.recipe import Recipe\n\n"
            f"recipe = Recipe.from_dict(json.loads({json.dumps(json.dumps(recipe.to_dict()))}))\n")
