"""``python -m moectl.cli``: the ``moectl`` command."""

from moectl.cli import main

main()
