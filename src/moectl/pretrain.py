"""``python -m moectl.pretrain``: ``moectl pretrain`` alone, for ``accelerate launch -m moectl.pretrain``.

The verb lives in :mod:`moectl.cli.pretrain`; this module only runs it.
"""

from __future__ import annotations

from moectl.cli.pretrain import main, pretrain_command

__all__ = ["main", "pretrain_command"]

if __name__ == "__main__":
    main()
