"""lm-eval task YAMLs over the converted evaluation sets (``@EVALS@`` is the cache directory).

Prompts, targets and metrics follow lm-eval's standard task definitions; only the data source
differs (local JSONL, see :mod:`moectl.eval.lm_tasks`). ``utils.py`` holds the functions the
YAMLs name with ``!function``.
"""
