"""Write the bytecode cache for the modules largebatch and its tests import, and only those.

`make setup` installs torch and the package with `pip install --no-compile`: pip's byte-compilation
of every file of torch took about 30 of the 39 s of torch's install on the 2-core machine, while a
run imports a small part of it. Importing the modules once here, with bytecode writing on even when
PYTHONDONTWRITEBYTECODE is set in the environment, caches exactly what later processes import
(each worker of `make train` and each test process then loads .pyc files instead of compiling).
"""
import importlib
import pkgutil
import sys

sys.dont_write_bytecode = False

import largebatch  # noqa: E402

EXTRA = ("torch.distributed.run", "torch.distributed.elastic.multiprocessing", "torch.nn.parallel",
         "torch._dynamo", "torch.utils.tensorboard", "matplotlib.pyplot", "matplotlib.backends.backend_agg",
         "rich.progress", "rich.table", "PIL.Image", "simplejpeg", "yaml", "numpy", "pytest", "_pytest.main")

failed = []
for mod in [m.name for m in pkgutil.walk_packages(largebatch.__path__, "largebatch.")
            if not m.name.endswith("__main__")] + list(EXTRA):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # optional extras (tensorboard) may be missing: nothing to cache
        failed.append(f"{mod} ({type(exc).__name__})")
print(f"bytecode cached for {len(sys.modules)} modules" + (f"; not importable: {', '.join(failed)}" if failed else ""))
