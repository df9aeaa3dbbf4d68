"""``python -m moectl``: the ``moectl`` command, so ``accelerate launch -m moectl VERB …`` runs any verb."""

from moectl.cli import main

main()
