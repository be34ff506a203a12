"""The lab's verbs: one module each, registered in the entry-point group ``ropekit.verbs`` (lab/pyproject.toml).

Each module has ``add_parser(verbs)`` (torch-free: ``ropekit --help`` loads every verb) and
``run(args)``, like the library's verb modules of :mod:`ropekit.cli`; ``ropekit``'s command line
applies its rules to them (one line and exit 2 for bad input, modules checked before the work,
output folders checked before the work and tidied after a failure).
"""
