"""The ``mmgoal`` command: ``main.py`` dispatches ``mmgoal COMMAND`` to one module per command
(``train``, ``evaluate``, ``export``, ...), each with ``main(argv) -> int``, and ``arguments.py``
holds the options and checks they share (docs/architecture.md: the top layer, which nothing
in the package imports; docs/getting_started.md, "The mmgoal command")."""
