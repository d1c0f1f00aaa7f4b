"""_formats/numerics: the math both ends agree on. ``optimizer_rules.py`` (update rules, run
where a variable lives), ``initializers.py`` and ``schedules.py`` (evaluated on the ps),
``idhash.py`` (which ps holds a raw id, and its initial row) and ``casting.py`` (which dtype
conversions pstrain makes)."""
