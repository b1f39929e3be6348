"""Recipes: the LR at every iteration, validation of bad values, the built-in ImageNet tables."""
import dataclasses
import json

import pytest

from speedrun.recipe import OptimizerSettings, Phase, Recipe, RecipeError, Target
from speedrun.recipes import BUILTIN, load_recipe
from speedrun.recipes.folder import folder_small


def make(*phases, **kw) -> Recipe:
    return Recipe(name="t", phases=tuple(phases), **kw)


def lr_by_definition(phases, epoch, step, steps):
    """The schedule's definition written out independently of Recipe.lr_at: find the row, then
    constant or start + (end - start) * fraction of the row's epochs done."""
    for p in phases:
        if p.start <= epoch < p.end:
            if isinstance(p.lr, tuple):
                done = (epoch - p.start) + step / steps
                return p.lr[0] + (p.lr[1] - p.lr[0]) * done / (p.end - p.start)
            return p.lr
    raise AssertionError("no phase")


def test_lr_at_every_iteration_matches_definition_across_edges_and_batch_changes():
    phases = (
        Phase(0, 2, size=20, batch_size=64, lr=(0.1, 0.4)),
        Phase(2, 3, size=20, batch_size=128, lr=0.4),  # batch-size change only
        Phase(3, 5, size=28, batch_size=96, lr=(0.4, 0.0)),
    )
    recipe = make(*phases)
    n = 1000
    seen = []
    for epoch in range(recipe.epochs):
        steps = n // recipe.phase_at(epoch).batch_size
        for step in range(steps):
            lr = recipe.lr_at(epoch, step, steps)
            assert lr == pytest.approx(lr_by_definition(phases, epoch, step, steps), abs=1e-12)
            seen.append((epoch, step, lr))
    # Phase edges: the first iteration of each phase takes the phase's starting LR exactly.
    assert recipe.lr_at(0, 0, 15) == 0.1
    assert recipe.lr_at(2, 0, 7) == 0.4
    assert recipe.lr_at(3, 0, 10) == 0.4
    # Linear warmup: halfway through epoch 1 of a 2-epoch ramp is 3/4 of the way.
    assert recipe.lr_at(1, 5, 10) == pytest.approx(0.1 + 0.3 * 0.75)
    # The ramp never reaches its end value inside the phase; the last step is one step short.
    assert recipe.lr_at(4, 9, 10) == pytest.approx(0.4 * (1 - 19 / 20))
    # Monotone inside each linear ramp.
    warm = [lr for e, s, lr in seen if e < 2]
    assert warm == sorted(warm)
    decay = [lr for e, s, lr in seen if e >= 3]
    assert decay == sorted(decay, reverse=True)


def test_linear_scaling_rule_for_other_world_sizes():
    recipe = make(Phase(0, 1, size=8, batch_size=4, lr=0.8), world_size=8)
    assert recipe.lr_at(0, 0, 10, world_size=8) == pytest.approx(0.8)
    assert recipe.lr_at(0, 0, 10, world_size=2) == pytest.approx(0.2)
    assert recipe.lr_at(0, 9, 10, world_size=16) == pytest.approx(0.8 * (1 + 0.9 / 5))  # warming up
    assert (make(Phase(0, 6, size=8, batch_size=4, lr=0.8), world_size=8).lr_at(5, 0, 10, world_size=16)
            == pytest.approx(1.6))


@pytest.mark.parametrize(
    "phases, expected",
    [
        ((), "has no phases"),
        ((Phase(1, 2, 8, 4, 0.1),), "starts at epoch 1, not 0"),
        ((Phase(0, 2, 8, 4, 0.1), Phase(3, 4, 8, 4, 0.1)), "gap after the previous phase"),
        ((Phase(0, 2, 8, 4, 0.1), Phase(1, 4, 8, 4, 0.1)), "overlaps the previous phase"),
        ("abc", "phases must be a tuple of speedrun.Phase, got 'abc'"),
    ],
)
def test_phases_that_do_not_follow_each_other_are_refused_when_the_recipe_is_made(phases, expected):
    with pytest.raises(RecipeError) as e:
        make(*phases) if isinstance(phases, tuple) else Recipe("t", phases=phases)
    assert any(expected in p for p in e.value.problems), e.value.problems


@pytest.mark.parametrize(
    "args, kw, expected",
    [
        ((0, 0, 8, 4, 0.1), {}, "0 <= start < end"),
        ((0, 1, 0, 4, 0.1), {}, "image size must be a whole number in 1..4096 (pixels), got 0"),
        ((0, 1, -3, 4, 0.1), {}, "image size must be a whole number in 1..4096 (pixels), got -3"),
        ((0, 1, 10**6, 4, 0.1), {}, "image size must be a whole number in 1..4096"),
        ((0, 1, 8.5, 4, 0.1), {}, "image size must be a whole number"),
        ((0, 1, 8, -2, 0.1), {}, "batch size must be a whole number in 1..65,536 (images per device)"),
        ((0, 1, 8, 4, 0.0), {}, "LR must be a positive number"),
        ((0, 1, 8, 4, "fast"), {}, "LR must be a positive number or a (start, end) pair, got 'fast'"),
        ((0, 1, 8, 4, (-0.1, 0.2)), {}, "LR must be a positive number"),
        ((0, 1, 8, 4, (0.1, -0.2)), {}, "LR must be a number >= 0"),
        ((0, 1, 8, 4, 0.1), {"min_scale": 1.5}, "min_scale must be in (0, 1]"),
        ((0, 1, 8, 4, 0.1), {"copy": "huge"}, "unknown data copy 'huge'"),
        ((0, 1, 8, 4, 0.1), {"ratio": (4 / 3, 3 / 4)}, "ratio must be a (low, high) pair"),
        ((0, 1, 8, 4, 0.1), {"ratio": (0.0, 1.0)}, "ratio must be a (low, high) pair"),
        ((0, 1, 8, 4, 0.1), {"translate": 0.6}, "translate must be a fraction"),
        ((0, 1, 8, 4, 0.1), {"crop_pct": 1.14}, "crop_pct must be in (0, 1]"),
        ((0, 1, 8, 4, 0.1), {"crop_pct": 0}, "crop_pct must be in (0, 1]"),
        ((0, 1, 8, 4, 0.1), {"flip": "yes"}, "flip must be True or False"),
    ],
)
def test_a_bad_phase_is_refused_when_it_is_made_one_line_each(args, kw, expected):
    with pytest.raises(RecipeError) as e:
        Phase(*args, **kw)
    assert isinstance(e.value, ValueError)  # what a Python caller catches
    assert any(expected in p for p in e.value.problems), e.value.problems
    assert all(p.startswith("phase (epochs ") and "\n" not in p for p in e.value.problems)


@pytest.mark.parametrize("make_it, expected", [
    (lambda: Target("top7", 0.5), "target: unknown metric 'top7'"),
    (lambda: Target("top1", float("nan")), "target: value must be a fraction in (0, 1], got nan"),
    (lambda: OptimizerSettings(momentum=1.5), "optimizer: momentum must be in [0, 1), got 1.5"),
    (lambda: OptimizerSettings(name="adam"), "optimizer: unknown optimizer 'adam'"),
    (lambda: OptimizerSettings(weight_decay="none"), "optimizer: weight decay must be a number >= 0"),
    (lambda: make(Phase(0, 1, 8, 4, 0.1), world_size=0), "world_size must be a whole number >= 1, got 0"),
    (lambda: make(Phase(0, 1, 8, 4, 0.1), model=5), "model must be a name (a non-empty string), got 5"),
    (lambda: make(Phase(0, 1, 8, 4, 0.1), target="top1=0.9"), "target must be a speedrun.Target or None"),
    (lambda: make(Phase(0, 1, 8, 4, 0.1), scale_warmup_epochs=-1), "scale_warmup_epochs must be a number >= 0"),
    (lambda: make(Phase(0, 1, 8, 4, 0.1), eval_every=0), "eval_every must be a whole number >= 1"),
    (lambda: make(Phase(0, 1, 8, 4, 0.1), train_examples=True), "train_examples must be a positive integer"),
])
def test_targets_optimizers_and_recipes_are_checked_when_they_are_made(make_it, expected):
    with pytest.raises(RecipeError) as e:
        make_it()
    assert any(expected in p for p in e.value.problems), e.value.problems


def test_several_problems_are_all_reported():
    with pytest.raises(RecipeError) as e:
        Phase(0, 1, 0, 0, -1.0)
    assert len(e.value.problems) == 3, e.value.problems
    with pytest.raises(RecipeError) as e:
        Target("top9", 2.0)
    assert len(e.value.problems) == 2, e.value.problems


def test_lists_read_from_json_become_pairs():
    phase = Phase(0, 1, 8, 4, [0.1, 0.0], ratio=[1, 1])
    assert phase.lr == (0.1, 0.0) and phase.ratio == (1, 1)
    assert make(phase).phases == Recipe("t", phases=[phase]).phases == (phase,)


def test_geometry_survives_the_round_trip_through_a_checkpoint_dict():
    recipe = make(Phase(0, 1, 8, 4, 0.1, ratio=(0.9, 1.1), translate=0.1, flip=False, crop_pct=1.0))
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe


@pytest.mark.parametrize("side, count, sizes, epochs, batch", [
    (28, 60_000, (20, 24, 28), 14, 128),  # Fashion-MNIST as a folder: the fashion-mnist recipe's sizes
    (48, 4_000, (36, 40, 48), 48, 128),  # a small folder gets more epochs (1,500 steps at least)
    (300, 60_000, (48, 56, 64), 14, 128),  # larger images are trained at 64 px at most
    (32, 600, (24, 28, 32), 60, 32),  # a folder of under 10 batches: smaller batches, epochs capped
])
def test_folder_small_is_fitted_to_the_folder(side, count, sizes, epochs, batch):
    recipe = folder_small(side, count).validate()
    assert tuple(dict.fromkeys(p.size for p in recipe.phases)) == sizes
    assert recipe.epochs == epochs and {p.batch_size for p in recipe.phases} == {batch}
    assert recipe.dataset == "imagefolder" and recipe.phases[-1].crop_pct == 1.0
    assert recipe.phases[-1].lr[1] == 0.0 and recipe.lr_at(0, 0, 10) < recipe.lr_at(1, 0, 10)  # warmup, then decay to 0


def test_ramp_to_zero_is_allowed_and_builtins_are_valid():
    assert make(Phase(0, 1, 8, 4, (0.1, 0.0))).problems() == []
    for recipe in BUILTIN.values():
        assert recipe.problems() == [], recipe.name


def test_target_parsing():
    assert Target.parse("top5=0.93") == Target("top5", 0.93)
    assert Target.parse("top1=92") == Target("top1", 0.92)
    assert Target.parse(str(Target("top1", 0.92))) == Target("top1", 0.92)  # as a recipe's target prints: top1>=0.92
    with pytest.raises(RecipeError):
        Target.parse("top3=0.5")
    with pytest.raises(RecipeError):
        Target.parse("top1=high")


def test_with_epochs_cuts_and_keeps_the_lr_line():
    recipe = make(Phase(0, 2, 8, 4, 0.1), Phase(2, 6, 8, 4, (0.4, 0.0)))
    cut = recipe.with_epochs(4)
    assert cut.epochs == 4 and len(cut.phases) == 2
    assert cut.phases[1].lr == (0.4, pytest.approx(0.2))
    assert recipe.with_epochs(1).phases == (Phase(0, 1, 8, 4, 0.1),)


def test_recipe_roundtrips_through_plain_data():
    for recipe in BUILTIN.values():
        assert Recipe.from_dict(recipe.to_dict()) == recipe


def test_recipe_file_loading(tmp_path):
    good = tmp_path / "mine.py"
    good.write_text(
        "from speedrun import Phase, Recipe\n"
        "recipe = Recipe(name='mine', dataset='fashion-mnist', model='resnet-fmnist-tiny',\n"
        "                phases=(Phase(0, 1, size=28, batch_size=32, lr=0.1),))\n"
    )
    assert load_recipe(str(good)).name == "mine"
    bad = tmp_path / "bad.py"
    bad.write_text("from speedrun import Phase, Recipe\n"
                   "recipe = Recipe(name='bad', phases=(Phase(0, 1, 28, 0, 0.1),))\n")
    with pytest.raises(RecipeError, match=r"^recipe file '.*bad.py': phase \(epochs 0-1\): batch size must be"):
        load_recipe(str(bad))
    with pytest.raises(RecipeError, match="must define a variable `recipe`"):
        (tmp_path / "empty.py").write_text("x = 1\n")
        load_recipe(str(tmp_path / "empty.py"))
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(str(tmp_path / "missing.py"))
    with pytest.raises(RecipeError, match="unknown recipe"):
        load_recipe("imagenet-3x8")


# The 2018 schedules as printed in docs/record.md ("The schedules"), one tuple per row:
# (start, end, size, per-GPU batch, LR (constant or (start, end)), min_scale, rect_val, copy).
TABLES = {
    "imagenet-16x8": (128, [
        (0, 6, 128, 64, (1.88, 3.76), 0.08, False, 160),
        (6, 16, 128, 128, 3.76, 0.08, False, 160),
        (16, 19, 224, 64, 1.88, 0.08, False, None),
        (19, 31, 224, 192, 0.564, 0.08, False, None),
        (31, 37, 224, 192, 0.0564, 0.08, False, None),
        (37, 38, 288, 128, 0.0376, 0.5, True, None),
        (38, 50, 288, 128, 0.00376, 0.5, True, None),
    ]),
    "imagenet-8x8": (64, [
        (0, 6, 128, 128, (1.92, 3.84), 0.08, False, 160),
        (6, 11, 128, 256, 3.84, 0.08, False, 160),
        (11, 14, 128, 256, (3.84, 1.92), 0.08, False, 160),
        (14, 17, 224, 128, 1.92, 0.087, False, 352),
        (17, 23, 224, 224, (1.92, 0.336), 0.087, False, 352),
        (23, 29, 224, 224, (0.336, 0.0336), 0.087, False, 352),
        (29, 36, 288, 128, (0.0192, 0.00192), 0.5, True, None),
    ]),
    "imagenet-4x8": (32, [
        (0, 6, 128, 256, (2.0, 4.0), 0.08, False, 160),
        (6, 11, 128, 512, 4.0, 0.08, False, 160),
        (11, 13, 128, 512, (4.0, 2.0), 0.08, False, 160),
        (13, 16, 224, 224, 1.75, 0.087, False, 352),
        (16, 24, 224, 224, (1.75, 0.175), 0.087, False, 352),
        (24, 28, 224, 224, (0.175, 0.0175), 0.087, False, 352),
        (28, 30, 288, 128, (0.01, 0.001), 0.5, True, None),
    ]),
    "imagenet-2x8": (16, [
        (0, 6, 128, 256, (1.5, 3.0), 0.08, False, 160),
        (6, 11, 128, 512, 3.0, 0.08, False, 160),
        (11, 13, 128, 512, (3.0, 1.5), 0.08, False, 160),
        (13, 16, 224, 224, 1.3125, 0.087, False, 352),
        (16, 23, 224, 224, (1.3125, 0.13125), 0.087, False, 352),
        (23, 28, 224, 224, (0.13125, 0.013125), 0.087, False, 352),
        (28, 30, 288, 128, (0.0075, 0.00075), 0.5, True, None),
    ]),
    "imagenet-1x8": (8, [
        (0, 7, 128, 512, (1.0, 2.0), 0.08, False, 160),
        (7, 13, 128, 512, (2.0, 0.25), 0.08, False, 160),
        (13, 22, 224, 224, (0.4375, 0.04375), 0.087, False, 352),
        (22, 25, 224, 224, (0.04375, 0.004375), 0.087, False, 352),
        (25, 28, 288, 128, (0.0025, 0.00025), 0.5, True, None),
    ]),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_builtin_imagenet_schedules_equal_the_record_tables(name):
    world_size, rows = TABLES[name]
    recipe = BUILTIN[name]
    assert recipe.world_size == world_size
    assert recipe.model == "resnet50" and recipe.target == Target("top5", 0.93)
    assert recipe.optimizer.momentum == 0.9 and recipe.optimizer.weight_decay == 1e-4
    assert recipe.optimizer.no_decay == "bn"
    got = [dataclasses.astuple(p)[:8] for p in recipe.phases]
    assert got == rows
    # The 2018 loader's geometry on every row: torchvision's aspect jitter, no translation,
    # flips, and validation resized to 1.14x the size then centre-cropped.
    assert ({(p.ratio, p.translate, p.flip, p.crop_pct) for p in recipe.phases}
            == {((3 / 4, 4 / 3), 0.0, True, 1 / 1.14)})


def test_batch_size_only_changes_share_the_data_key():
    recipe = BUILTIN["imagenet-16x8"]
    keys = [p.data_key for p in recipe.phases]
    assert keys[0] == keys[1]  # 64 -> 128 at 128 px: batch change only
    assert keys[2] == keys[3] == keys[4]
    assert keys[1] != keys[2]


@pytest.mark.parametrize("name", ["imagenet-1x8", "imagenet-8x8", "fashion-mnist", "tiny"])
def test_longer_runs_stretch_the_whole_schedule(name):
    # --epochs beyond the recipe stretches every phase by the same factor (the LR values stay;
    # extending the last LR line instead drove ImageNet's last LR below zero).
    recipe = BUILTIN[name]
    factor = 2
    long = recipe.with_epochs(factor * recipe.epochs)
    assert long.validate() is long
    assert long.epochs == factor * recipe.epochs
    assert [(p.start, p.end) for p in long.phases] == [(factor * p.start, factor * p.end) for p in recipe.phases]
    assert [p.lr for p in long.phases] == [p.lr for p in recipe.phases]
    # The same point of the schedule has the same LR: epoch e of the original is epoch 2e here.
    for epoch in range(recipe.epochs):
        assert long.lr_at(factor * epoch, 0, 10) == pytest.approx(recipe.lr_at(epoch, 0, 10))
    # Stretching by an odd factor keeps every phase non-empty and the LRs non-negative.
    odd = recipe.with_epochs(recipe.epochs + 3)
    assert odd.validate() is odd and odd.epochs == recipe.epochs + 3
    assert all(odd.lr_at(e, s, 4) >= 0 for e in range(odd.epochs) for s in range(4))


def test_scaled_lr_warms_up_from_the_recipes_own_value():
    # A recipe written for 1 device on 4: the LR ramps from the written value to 4x over the
    # recipe's scale_warmup_epochs (Goyal et al. 2017), then stays at 4x.
    recipe = make(Phase(0, 10, 8, 4, 0.1), scale_warmup_epochs=2)
    assert recipe.lr_at(0, 0, 10, world_size=1) == pytest.approx(0.1)
    assert recipe.lr_at(0, 0, 10, world_size=4) == pytest.approx(0.1)
    assert recipe.lr_at(1, 0, 10, world_size=4) == pytest.approx(0.1 * 2.5)  # halfway: 1 + 3 * 0.5
    lrs = [recipe.lr_at(e, s, 10, world_size=4) for e in range(2) for s in range(10)]
    assert all(a < b for a, b in zip(lrs, lrs[1:]))
    assert [recipe.lr_at(e, 3, 10, world_size=4) for e in range(2, 10)] == [pytest.approx(0.4)] * 8
    # Fewer devices than written for: the LR only shrinks, no ramp.
    wide = make(Phase(0, 10, 8, 4, 0.8), world_size=8, scale_warmup_epochs=2)
    assert wide.lr_at(0, 0, 10, world_size=2) == pytest.approx(0.2)
    with pytest.raises(RecipeError):
        make(Phase(0, 2, 8, 4, 0.1), scale_warmup_epochs=-1)
