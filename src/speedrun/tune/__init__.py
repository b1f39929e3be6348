"""Recipes that fit themselves: the LR range test (`lr_find`) and the search for the shortest time
or the fewest dollars to a target (`speedrun tune`)."""
from speedrun.tune.lr_find import LRFinding, lr_find

__all__ = ["LRFinding", "lr_find"]
