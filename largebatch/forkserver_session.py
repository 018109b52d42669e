"""Imported first by the workers' forkserver (`launch.WORKER_PRELOAD`) and by a study's cells' forkserver
(`cells.CELL_PRELOAD`): the forkserver leaves its starter's session (the launcher's, the study's) for one of its
own. In the launcher's process group a signal to the whole group (a terminal hang-up, `kill -- -PGID`,
`timeout`) killed it at once, and multiprocessing then reports every live worker as ended (exit code 255): the
agent stopped waiting for workers that were still writing their checkpoint. Its starter still stops it at the
end (`launch.stop_forkserver`), and it ends when its starter dies (its "alive" pipe). Anywhere else this module
does nothing."""
import os
import sys

if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules and os.getsid(0) != os.getpid():
    os.setsid()
