"""`recipe_for`: the recipe a command names, fitted to its image folder when it is one of the
recipes fitted to their data (`recipes.FITTED`). Apart from the package's face because it reads
the data (speedrun.data), which itself looks up the built-in recipes."""
from __future__ import annotations

from speedrun.data import folder_summary, is_image_folder
from speedrun.errors import SpeedrunError
from speedrun.recipe import Recipe
from speedrun.recipes import FITTED, load_recipe


def recipe_for(name_or_path: str, data: str | None, workers: int | None = None) -> Recipe:
    """A built-in recipe or a recipe file (`load_recipe`); a recipe fitted to its data
    (`recipes.FITTED`) is fitted to the image folder at `data`."""
    if name_or_path not in FITTED:
        return load_recipe(name_or_path)
    if data is None or not is_image_folder(data):
        where = f"{data} is not one" if data is not None else "give one with --data DIR"
        raise SpeedrunError(f"recipe {name_or_path} is fitted to an image folder (train/<class>/, val/<class>/): "
                            f"{where}")
    side, count = folder_summary(data, workers)
    return FITTED[name_or_path](side, count).validate()
