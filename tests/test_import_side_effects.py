"""Importing moectl changes no process-wide setting: every module of the package is imported in a fresh
interpreter and the environment, matplotlib's backend, torch's defaults and the warning filters
are compared before and after. Settings a task needs are scoped to the task (e.g. the hub is
offline only while ``moectl eval`` runs lm-eval on its local data: ``lm_tasks.hub_offline``)."""

from __future__ import annotations

import json
import subprocess
import sys

# modules not imported, with why
SKIP = {
    "moectl.__main__": "runs the command line (python -m moectl)",
    "moectl.cli.__main__": "runs the command line (python -m moectl.cli)",
    "moectl.lm_eval.__main__": "runs lm-eval's command line (python -m moectl.lm_eval)",
}

CODE = r"""
import importlib, json, os, pkgutil, sys, traceback, warnings
import matplotlib, torch
import moectl

root = os.path.dirname(moectl.__file__)
environ = type(os.environ)
set_item, del_item = environ.__setitem__, environ.__delitem__
writes = []  # (variable, the file and line that set or removed it)


def writer():
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.endswith(("/os.py", "_collections_abc.py")):
            return f"{frame.filename}:{frame.lineno}"


def setitem(self, key, value):
    writes.append((key, writer()))
    set_item(self, key, value)


def delitem(self, key):
    writes.append((key, writer()))
    del_item(self, key)


def setdefault(self, key, value=None):  # a write even where the variable is set already
    writes.append((key, writer()))
    return os.environ[key] if key in os.environ else (set_item(self, key, value) or value)


environ.__setitem__, environ.__delitem__, environ.setdefault = setitem, delitem, setdefault
filters = []  # the file and line of each warning filter added
for function in ("filterwarnings", "simplefilter"):
    def added(*args, _inner=getattr(warnings, function), **kwargs):
        filters.append(writer())
        return _inner(*args, **kwargs)
    setattr(warnings, function, added)
skip = set(json.loads(sys.argv[1]))


def settings():
    return {
        "env": dict(os.environ),
        "backend": dict.__getitem__(matplotlib.rcParams, "backend"),  # without resolving the default
        "dtype": str(torch.get_default_dtype()),
        "threads": torch.get_num_threads(),
    }


before = settings()
names = [m.name for m in pkgutil.walk_packages(moectl.__path__, "moectl.") if m.name not in skip]
for name in names:
    importlib.import_module(name)
after = settings()
print(json.dumps({
    "imported": len(names),
    "changed": sorted(k for k in set(before["env"]) | set(after["env"]) if before["env"].get(k) != after["env"].get(k)),
    "by_moectl": [(k, at) for k, at in writes if at and at.startswith(root)],
    "third_party": sorted({k for k, at in writes if not (at and at.startswith(root))}),
    "filters_by_moectl": [at for at in filters if at and at.startswith(root)],
    "others": {k: (before[k], after[k]) for k in before if k != "env" and before[k] != after[k]},
}, default=str))
"""


def test_importing_every_moectl_module_changes_no_process_setting():
    done = subprocess.run(
        [sys.executable, "-c", CODE, json.dumps(sorted(SKIP))], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported"] > 200  # the walk found the package
    assert report["by_moectl"] == [], "moectl sets environment variables at import"
    # what changed was set by other libraries moectl imports (lm-eval, torch's inductor), not by moectl
    assert set(report["changed"]) <= set(report["third_party"]), report
    assert report["filters_by_moectl"] == [], "moectl adds warning filters at import"
    assert report["others"] == {}, "moectl changes matplotlib's backend or torch's defaults at import"
