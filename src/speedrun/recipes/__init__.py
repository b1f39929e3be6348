"""Built-in recipes, by name. `speedrun recipes` lists them."""
from speedrun.recipe import Recipe
from speedrun.recipes.fashion_mnist import fashion_mnist, tiny
from speedrun.recipes.imagenet import imagenet_1x8, imagenet_2x8, imagenet_4x8, imagenet_8x8, imagenet_16x8

BUILTIN: dict[str, Recipe] = {
    r.name: r
    for r in (fashion_mnist, tiny, imagenet_1x8, imagenet_2x8, imagenet_4x8, imagenet_8x8, imagenet_16x8)
}
DEFAULT = fashion_mnist.name
