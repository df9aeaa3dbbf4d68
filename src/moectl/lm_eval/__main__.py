"""``python -m moectl.lm_eval``: lm-eval's command line (``lm_eval``), with ``--model moectl`` registered.

    python -m moectl.lm_eval --model moectl --model_args pretrained=DIR,policy=FILE --tasks arc_easy [any lm_eval flag]
"""

from __future__ import annotations

import sys

from moectl.lm_eval import register


def main(argv: list[str] | None = None) -> None:
    """Run lm-eval's command line on ``argv`` (default: ``sys.argv[1:]``) after registering moectl."""
    register()
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
