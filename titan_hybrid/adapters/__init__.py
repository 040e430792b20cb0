"""One adapter per torchtitan API generation (torchtitan_0_2/, torchtitan_0_3/), the names both
spell alike (command_line.py), and the pick of the installed torchtitan's front end
(installed.py)."""
