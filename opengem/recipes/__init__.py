"""Named presets, the only place sizes are chosen: GEM recipes (``gem``), student presets
(``students``) and synthetic worlds (``worlds``), each a Python function returning a full config.

    recipe("demo")                      → Config         (tiny, demo, small, medium, large, xl)
    student_recipe("vm_s")              → Config         (vm_xs, vm_s, vm_m, fm_domain, or a GEM recipe)
    world_config("tiny", seed=1)        → WorldConfig    (tiny, demo, small, large)

Change one with the one override path: ``apply_overrides(recipe("demo"), ["optim.lr=1e-3"])``,
``world_config("demo", overrides=["sizes.num_users=3000"])``; a student and its transfer techniques
take ``apply_prefixed_overrides({"": cfg, "transfer": tcfg}, items)`` (``opengem.config``).
"""

from opengem.recipes.gem import GEMSize, recipe, recipe_names
from opengem.recipes.students import StudentSize, student_recipe, student_recipe_names
from opengem.recipes.worlds import world_config, world_names

__all__ = ["GEMSize", "StudentSize", "recipe", "recipe_names", "student_recipe", "student_recipe_names",
           "world_config", "world_names"]
