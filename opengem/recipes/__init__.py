"""Named presets, the only place sizes are chosen: GEM recipes (``gem``) and student presets
(``students``), each a Python function returning a full config. Synthetic worlds have theirs in
``opengem.world.presets``.

    recipe("demo")                      → Config         (tiny, demo, small, medium, large, xl)
    student_recipe("vm_s")              → Config         (vm_xs, vm_s, vm_m, fm_domain, or a GEM recipe)

Change one with the one override path: ``apply_overrides(recipe("demo"), ["optim.lr=1e-3"])``; a
student and its transfer techniques take ``apply_prefixed_overrides({"": cfg, "transfer": tcfg},
items)`` (``opengem.config``).
"""

from opengem.recipes.gem import GEMSize, recipe, recipe_names
from opengem.recipes.students import StudentSize, student_recipe, student_recipe_names

__all__ = ["GEMSize", "StudentSize", "recipe", "recipe_names", "student_recipe",
           "student_recipe_names"]
