"""Recipes: built-ins load; unknown keys, passes and wrong types are one-line user errors."""

import pytest

from edgeq.errors import UserInputError
from edgeq.recipes import DEFAULT_RECIPE, builtin_recipe_names, load_recipe, parse_recipe


def test_builtins_load():
    names = builtin_recipe_names()
    assert DEFAULT_RECIPE in names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.passes and recipe.description


def test_config_values_reach_the_pass():
    r = parse_recipe('[[pass]]\nname = "qdq"\nactivation_observer = "mse"\nskip_roles = ["lm_head"]\n', "t")
    cfg = r.passes[0].config
    assert cfg.activation_observer == "mse" and cfg.skip_roles == ("lm_head",)
    assert r.calibration.windows == 16


@pytest.mark.parametrize("text,needle", [
    ('bogus = 1\n[[pass]]\nname = "qdq"\n', "unknown key"),
    ('[[pass]]\nname = "nosuchpass"\n', "unknown pass"),
    ('[[pass]]\nname = "qdq"\nactivation_bitz = 8\n', "unknown key"),
    ('[[pass]]\nname = "qdq"\nactivation_dtype = 8\n', "expected str"),
    ('[[pass]]\nname = "qdq"\nactivation_dtype = "int3"\n', "activation_dtype"),
    ('[calibration]\nwindowz = 3\n[[pass]]\nname = "qdq"\n', "unknown key"),
    ('description = "x"\n', "at least one"),
    ('[[pass]\n', "invalid TOML"),
])
def test_bad_recipes(text, needle):
    with pytest.raises(UserInputError, match=needle):
        parse_recipe(text, "t")


def test_unknown_recipe_name():
    with pytest.raises(UserInputError, match="unknown recipe"):
        load_recipe("w9a9")
